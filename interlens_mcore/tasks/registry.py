"""`--task NAME`: a task source by name, by `FAMILY:ID` of an outside task library, or `MODULE:FACTORY`.

    guess | duel                       our toy games
    reasoning_gym:NAME                 a reasoning-gym dataset (or "a+b" composite), verifier as reward
    gym:ENV_ID                         a gymnasium toy-text environment (FrozenLake-v1, Taxi-v4, ...)
    textarena:GAME_ID                  a two-player textarena game as a two-seat lineup
    verifiers:ENV                      a verifiers environment's own rollouts, its rubric as reward
                                       (ENV an installed environment, a .py file, or MODULE:FN)
    MODULE:FACTORY                     a function returning a TaskSource; MODULE is an importable
                                       module or a path to a .py file (as ms-swift's --external_plugins)

Task options travel with the task (`--task-args '{"max_guesses": 3}'`): they are the factory's
keyword arguments.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping

from ..plugins import load_object
from .base import TaskSource
from .families import FAMILIES as _LIBRARIES
from .families import extra_task_args, family_factory, make_source
from .toy import DuelTasks, GuessTasks

TASKS: dict[str, Callable[..., TaskSource]] = {"guess": GuessTasks, "duel": DuelTasks}
# FAMILY:ID sources: the factory takes the ID first (outside task libraries, imported when named)
FAMILIES: dict[str, Callable[..., TaskSource]] = {
    family: (lambda ident, _f=family, **args: make_source(f"{_f}:{ident}", **args)) for family in _LIBRARIES
}


_BUILT_IN = dict(FAMILIES)  # a family registered over one of these is checked by its own factory


def register_task(name: str, factory: Callable[..., TaskSource], *, family: bool = False) -> None:
    """Make `--task NAME` (or `--task NAME:ID` with `family=True`) build `factory(**task_args)`."""
    (FAMILIES if family else TASKS)[name] = factory


def known_tasks() -> list[str]:
    return [*TASKS, *(f"{f}:ID" for f in FAMILIES), "MODULE:FACTORY"]


def resolve_task(spec: str, task_args: dict[str, object] | None = None) -> TaskSource:
    """The task source `spec` names, built with `task_args`; ValueError naming --task otherwise."""
    args = dict(task_args or {})
    check_task_args(spec, args)
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
    except ValueError as exc:
        raise ValueError(str(exc) if str(exc).startswith("--task") else f"--task {spec}: {exc}") from None
    except Exception as exc:  # the user's factory failed: name it, not a traceback of it
        raise ValueError(f"--task {spec}: the factory raised {type(exc).__name__}: {exc}") from None
    if not isinstance(source, TaskSource):
        raise ValueError(
            f"--task {spec}: the factory returned {type(source).__name__}, expected an "
            "interlens_mcore.tasks.TaskSource"
        )
    return source


def check_task_args(spec: str, args: Mapping[str, object]) -> None:
    """ValueError naming the first task argument the factory of `spec` does not take (with the
    closest name it does), before anything is built. Factories taking `**kwargs` that cannot be
    listed are left to raise their own error."""
    accepted = _accepted(spec)
    if accepted is None:
        return
    for key in args:
        if key not in accepted:
            match = difflib.get_close_matches(key, sorted(accepted), n=1, cutoff=0.6)
            takes = ", ".join(sorted(accepted)) or "none"
            hint = f"did you mean {match[0]}?" if match else f"it takes {takes}"
            raise ValueError(f"--task-arg {key}: {spec} takes no {key} ({hint})")


def _accepted(spec: str) -> set[str] | None:
    """The task argument names `spec`'s factory takes, or None when they cannot be told."""
    family, _, ident = spec.partition(":")
    skip_first = False
    factory: Callable[..., object] | None = TASKS.get(spec)
    if factory is None and ident and family in _LIBRARIES and FAMILIES[family] is _BUILT_IN[family]:
        factory, skip_first = family_factory(family), True
    if factory is None:
        return None  # a registered family, or MODULE:FACTORY: checked when it is loaded
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return None
    if skip_first:
        params = params[1:]
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        extra = extra_task_args(family, ident) if skip_first else None
        return None if extra is None else names | extra
    return names
