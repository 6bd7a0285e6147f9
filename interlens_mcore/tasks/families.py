"""`--task FAMILY:NAME` to a task source: one factory per family of outside task libraries.

    make_source("reasoning_gym:basic_arithmetic", max_attempts=2)
    make_source("gym:FrozenLake-v1", is_slippery=False)
    make_source("textarena:TicTacToe-v0", opponent="random")

`parse_task_args` reads `--task-arg KEY=VALUE` pairs into typed keyword arguments. Each
family's module is imported only when named, so a missing optional package (`pip install
interlens_mcore[tasks]`) fails with its name, and only for the family that needs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from .base import TaskSource

FAMILIES = {
    "reasoning_gym": ("interlens_mcore.tasks.reasoning_gym", "reasoning-gym"),
    "gym": ("interlens_mcore.tasks.gym", "gymnasium"),
    "textarena": ("interlens_mcore.tasks.textarena", "textarena"),
}


def make_source(spec: str, **task_args: object) -> TaskSource:
    """The task source `spec` ("FAMILY:NAME") names, built by its family's `source(NAME, **task_args)`."""
    family, sep, name = spec.partition(":")
    if not sep or family not in FAMILIES or not name:
        raise ValueError(f"task {spec!r}: expected FAMILY:NAME with FAMILY one of {sorted(FAMILIES)}")
    module, package = FAMILIES[family]
    try:
        factory = importlib.import_module(module).source
        return factory(name, **task_args)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"task {spec!r} needs the package {package!r} ({exc}); install interlens_mcore[tasks]"
        ) from exc


def parse_task_args(pairs: Sequence[str]) -> dict[str, object]:
    """`["max_attempts=3", "is_slippery=false"]` (the `--task-arg KEY=VALUE` form) as typed values.

    Each value is read as YAML (`3` an int, `0.5` a float, `false` a bool, `null` None, `[1, 2]`
    a list); anything else stays a string (`1,3` for reasoning-gym weights).
    """
    import yaml

    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"task argument {pair!r}: expected KEY=VALUE with KEY a name")
        if key in out:
            raise ValueError(f"task argument {key!r} given twice")
        try:
            out[key] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            out[key] = value
    return out
