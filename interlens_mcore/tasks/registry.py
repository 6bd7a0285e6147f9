"""`--task NAME`: a task source by name, by `FAMILY:ID` of an outside task library, or `MODULE:FACTORY`.

    guess | duel                       our toy games
    reasoning_gym:NAME                 a reasoning-gym dataset (or "a+b" composite), verifier as reward
    gym:ENV_ID                         a gymnasium toy-text environment (FrozenLake-v1, Taxi-v4, ...)
    textarena:GAME_ID                  a two-player textarena game as a two-seat lineup
    MODULE:FACTORY                     a function returning a TaskSource; MODULE is an importable
                                       module or a path to a .py file (as ms-swift's --external_plugins)

Task options travel with the task (`--task-args '{"max_guesses": 3}'`): they are the factory's
keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable

from ..plugins import load_object
from .base import TaskSource
from .families import FAMILIES as _LIBRARIES
from .families import make_source
from .toy import DuelTasks, GuessTasks

TASKS: dict[str, Callable[..., TaskSource]] = {"guess": GuessTasks, "duel": DuelTasks}
# FAMILY:ID sources: the factory takes the ID first (outside task libraries, imported when named)
FAMILIES: dict[str, Callable[..., TaskSource]] = {
    family: (lambda ident, _f=family, **args: make_source(f"{_f}:{ident}", **args)) for family in _LIBRARIES
}


def register_task(name: str, factory: Callable[..., TaskSource], *, family: bool = False) -> None:
    """Make `--task NAME` (or `--task NAME:ID` with `family=True`) build `factory(**task_args)`."""
    (FAMILIES if family else TASKS)[name] = factory


def known_tasks() -> list[str]:
    return [*TASKS, *(f"{f}:ID" for f in FAMILIES), "MODULE:FACTORY"]


def resolve_task(spec: str, task_args: dict[str, object] | None = None) -> TaskSource:
    """The task source `spec` names, built with `task_args`; ValueError naming --task otherwise."""
    args = dict(task_args or {})
    try:
        if spec in TASKS:
            source = TASKS[spec](**args)
        elif ":" in spec and spec.split(":", 1)[0] in FAMILIES:
            family, ident = spec.split(":", 1)
            source = FAMILIES[family](ident, **args)
        elif ":" in spec:
            source = load_object(spec, what="--task")(**args)
        else:
            raise ValueError(
                f"--task {spec!r} is not a known task; expected one of {', '.join(known_tasks())}"
            )
    except TypeError as exc:  # a task argument the factory does not take
        raise ValueError(f"--task {spec}: bad --task-args {args}: {exc}") from None
    if not isinstance(source, TaskSource):
        raise ValueError(
            f"--task {spec}: the factory returned {type(source).__name__}, expected an "
            "interlens_mcore.tasks.TaskSource"
        )
    return source
