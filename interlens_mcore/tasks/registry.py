"""`--task NAME`: a task source by name, by `FAMILY:ID` of an outside task library, or `MODULE:FACTORY`.

    guess | duel                       our toy games
    MODULE:FACTORY                     a function returning a TaskSource; MODULE is an importable
                                       module or a path to a .py file (as ms-swift's --external_plugins)

Task options travel with the task (`--task-args '{"max_guesses": 3}'`): they are the factory's
keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..plugins import load_object
from .base import TaskSource
from .toy import DuelTasks, GuessTasks

TASKS: dict[str, Callable[..., TaskSource]] = {"guess": GuessTasks, "duel": DuelTasks}
# FAMILY:ID sources: the factory takes the ID first
FAMILIES: dict[str, Callable[..., TaskSource]] = {}


def register_task(name: str, factory: Callable[..., TaskSource], *, family: bool = False) -> None:
    """Make `--task NAME` (or `--task NAME:ID` with `family=True`) build `factory(**task_args)`."""
    (FAMILIES if family else TASKS)[name] = factory


def known_tasks() -> list[str]:
    return [*TASKS, *(f"{f}:ID" for f in FAMILIES), "MODULE:FACTORY"]


def resolve_task(spec: str, task_args: dict[str, Any] | None = None) -> TaskSource:
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
