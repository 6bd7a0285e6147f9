"""`--reward-funcs NAME ...`: names from the plugin files' `orms` dicts, then the built-ins.

ms-swift's rule: a plugin file's `orms = {"name": ORMClass}` adds names to the registry and
overrides a built-in of the same name. The plugin files are the `--external-plugins` files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..grpo.rewards import RewardFn
from ..plugins import load_module
from .builtins import BUILTINS, builtin
from .conventions import ORMReward, adapt


def plugin_orms(plugins: Sequence[str]) -> dict[str, object]:
    """Every `orms` dict of the plugin files, merged in the order given."""
    out: dict[str, object] = {}
    for path in plugins:
        module = load_module(path, what="--external-plugins")
        orms = vars(module).get("orms", {})
        if not isinstance(orms, Mapping) or not all(isinstance(k, str) for k in orms):
            raise ValueError(
                f"--external-plugins {path}: orms must be a dict of name -> ORM class, "
                f"got {type(orms).__name__}"
            )
        out.update(orms)
    return out


def named(names: Sequence[str], plugins: Sequence[str], *, max_new_tokens: int) -> list[RewardFn]:
    """The reward function of each name (ValueError naming `--reward-funcs` and what is known)."""
    orms = plugin_orms(plugins)
    out = []
    for name in names:
        what = f"--reward-funcs {name}"
        if name in orms:
            out.append(adapt(orms[name], what=what, name=name))
        elif name in BUILTINS:
            out.append(ORMReward(builtin(name, max_new_tokens=max_new_tokens), name))  # type: ignore[arg-type]
        else:
            from_plugins = f"; from --external-plugins: {', '.join(sorted(orms))}" if orms else ""
            raise ValueError(
                f"{what}: no such reward; built-in: {', '.join(BUILTINS)}{from_plugins} "
                "(a plugin file registers more in its orms dict)"
            )
    return out
