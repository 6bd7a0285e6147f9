"""Loading ms-swift style plugin files and naming their schedulers on the command line.

`--external-plugins FILE.py` loads a file as a module named after it; `--multi-turn-scheduler`
then names a class as `MODULE:CLASS` (e.g. `my_plugin:MathTips`), or a name the plugin put
in `multi_turns` (as ms-swift plugins register theirs).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path

from ... import MultiTurnScheduler as NativeScheduler
from ...chat import Tokenizer
from ...engines.base import Engine
from ...plugins import load_module
from .scheduler import InferEngine, MultiTurnScheduler, multi_turns


def load_plugins(paths: Sequence[str | Path]) -> list[str]:
    """Import each file as a module named after its stem; returns the module names."""
    names = []
    for path in map(Path, paths):
        if not path.is_file() or path.suffix != ".py":
            raise ValueError(f"external plugin {str(path)!r} is not a .py file")
        # registered under its stem, so MODULE:CLASS finds it and pickling by reference works
        names.append(load_module(str(path), what="--external-plugins").__name__)
    return names


def resolve_scheduler(spec: str) -> type[MultiTurnScheduler] | type[NativeScheduler]:
    """The scheduler class `MODULE:CLASS` names, or the one registered as `spec` in `multi_turns`.

    Native schedulers are accepted too: `issubclass(cls, compat.swift.MultiTurnScheduler)`
    tells which path (compat.swift.run or run_multi_turn) drives it.
    """
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        cls = getattr(importlib.import_module(module_name), attr, None)
        if cls is None:
            raise ValueError(f"--multi-turn-scheduler {spec!r}: module {module_name!r} has no {attr!r}")
    elif spec in multi_turns:
        cls = multi_turns[spec]
    else:
        raise ValueError(
            f"--multi-turn-scheduler {spec!r}: expected MODULE:CLASS or a name registered in "
            f"multi_turns {sorted(multi_turns)}"
        )
    if not (isinstance(cls, type) and issubclass(cls, (MultiTurnScheduler, NativeScheduler))):
        raise ValueError(f"--multi-turn-scheduler {spec!r} is {cls!r}, not a MultiTurnScheduler class")
    return cls


def build_scheduler(
    cls: type[MultiTurnScheduler] | type[NativeScheduler],
    *,
    engine: Engine | None = None,
    tokenizer: Tokenizer | None = None,
    max_turns: int | None = None,
    **kwargs,
) -> MultiTurnScheduler:
    """Construct a scheduler as ms-swift does: `cls(infer_engine=..., max_turns=..., **kwargs)`."""
    if not issubclass(cls, MultiTurnScheduler):
        raise ValueError(
            f"{cls.__name__} is a native scheduler (constructed with a ChatFormat), not a "
            "compat.swift.MultiTurnScheduler; drive it with run_multi_turn"
        )
    infer_engine = InferEngine(engine=engine, tokenizer=tokenizer) if engine is not None else None
    return cls(infer_engine=infer_engine, max_turns=max_turns, tokenizer=tokenizer, **kwargs)
