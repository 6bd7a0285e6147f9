"""Packages whose public names import on first use (PEP 562), so importing a package is cheap.

`import interlens_mcore` and `import interlens_mcore.tools` then cost no torch, megatron-core or
DeepSpeed import: tool workers, plug-in loaders and `--help` start in a fraction of a second.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def exports(
    package: str, table: Mapping[str, tuple[str, ...]], namespace: dict[str, Any]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose names `table` maps from their modules
    (relative to the package); a name is imported once, then found in `namespace`."""
    where = {name: module for module, names in table.items() for name in names}

    def getattr_(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # later lookups skip this hook
        return value

    def dir_() -> list[str]:
        return sorted([*namespace, *where])

    return getattr_, dir_
