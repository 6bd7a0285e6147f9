"""Loading ms-swift style plugin files and naming their schedulers and environments.

`--external-plugins FILE.py` loads a file as part of a package (its folder), so a relative
import in it (`from .gym_env import Env, envs`) finds its neighbours. `--multi-turn-scheduler`
then names a class as `MODULE:CLASS` (e.g. `my_plugin:MathTips`) or by a name in a
`multi_turns` dict: ours (`compat.swift.multi_turns`) or a loaded plugin file's own (ms-swift's
`multi_turn.py` defines one). `--gym-env NAME` names an environment the same way, in `envs`
dicts. A name several files register: the file loaded last wins over earlier ones and ours.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ... import MultiTurnScheduler as NativeScheduler
from ...chat import Tokenizer
from ...engines.base import Engine
from ...plugins import load_module
from .foreign import adapt, is_swift_style
from .gym import envs
from .scheduler import InferEngine, MultiTurnScheduler, multi_turns

_loaded: list[ModuleType] = []  # plugin modules, in the order they were first loaded


def load_plugins(paths: Sequence[str | Path]) -> list[str]:
    """Import each file as a module of its folder's package; returns the module names."""
    names = []
    for path in map(Path, paths):
        if not path.is_file() or path.suffix != ".py":
            raise ValueError(f"external plugin {str(path)!r} is not a .py file")
        module = load_module(str(path), what="--external-plugins")
        if all(m is not module for m in _loaded):
            _loaded.append(module)
        names.append(module.__name__)
    return names


def _tables(attr: str, ours: dict[str, Any]) -> list[dict[str, Any]]:
    """Our registry, then each loaded plugin's dict named `attr` (each dict once)."""
    tables = [ours]
    for module in _loaded:
        table = vars(module).get(attr)
        if isinstance(table, dict) and all(t is not table for t in tables):
            tables.append(table)
    return tables


def registered(attr: str, ours: dict[str, Any]) -> dict[str, Any]:
    """Every name in our registry and the plugins' dicts named `attr`; later files win."""
    merged: dict[str, Any] = {}
    for table in _tables(attr, ours):
        merged.update(table)
    return merged


def _unknown(flag: str, spec: str, what: str, known: dict[str, Any]) -> ValueError:
    names = ", ".join(sorted(known)) or "none"
    return ValueError(
        f"{flag} {spec!r}: no {what} of that name (registered: {names}); register one in a "
        f"--external-plugins file's {'multi_turns' if flag.endswith('scheduler') else 'envs'} "
        "dict" + (" or give MODULE:CLASS" if flag.endswith("scheduler") else "")
    )


def resolve_scheduler(spec: str) -> type:
    """The scheduler class `MODULE:CLASS` names, or the one registered as `spec`.

    Native schedulers are accepted too: `issubclass(cls, compat.swift.MultiTurnScheduler)`
    tells which path (compat.swift.run or run_multi_turn) drives it; a class written on
    ms-swift's own base classes is recognised by its hooks (foreign.py).
    """
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        cls = getattr(importlib.import_module(module_name), attr, None)
        if cls is None:
            raise ValueError(f"--multi-turn-scheduler {spec!r}: module {module_name!r} has no {attr!r}")
    else:
        known = registered("multi_turns", multi_turns)
        if spec not in known:
            raise _unknown("--multi-turn-scheduler", spec, "scheduler", known)
        cls = known[spec]
    ours = isinstance(cls, type) and issubclass(cls, (MultiTurnScheduler, NativeScheduler))
    if not (ours or is_swift_style(cls)):
        raise ValueError(
            f"--multi-turn-scheduler {spec!r} is {cls!r}, not a scheduler class (a MultiTurnScheduler, "
            "or a class with ms-swift's check_finished, step and on_turn_end)"
        )
    return cls


def resolve_gym_env(name: str) -> type:
    """The environment class registered as `name`, put under `name` in every `envs` dict seen,
    so a scheduler that looks it up in its own file's registry (ms-swift's GYMScheduler does:
    `envs[gym_env]`) finds the same class."""
    known = registered("envs", envs)
    if name not in known:
        raise _unknown("--gym-env", name, "environment", known)
    cls = known[name]
    for table in _tables("envs", envs):
        table[name] = cls
    return cls


def build_scheduler(
    cls: type,
    *,
    engine: Engine | None = None,
    tokenizer: Tokenizer | None = None,
    max_turns: int | None = None,
    **kwargs,
) -> MultiTurnScheduler:
    """Construct a scheduler as ms-swift does: `cls(infer_engine=..., max_turns=..., **kwargs)`."""
    infer_engine = InferEngine(engine=engine, tokenizer=tokenizer) if engine is not None else None
    if issubclass(cls, MultiTurnScheduler):
        return cls(infer_engine=infer_engine, max_turns=max_turns, tokenizer=tokenizer, **kwargs)
    if issubclass(cls, NativeScheduler):
        raise ValueError(
            f"{cls.__name__} is a native scheduler (constructed with a ChatFormat), not a "
            "compat.swift.MultiTurnScheduler; drive it with run_multi_turn"
        )
    return adapt(cls, infer_engine=infer_engine, max_turns=max_turns, tokenizer=tokenizer, **kwargs)
