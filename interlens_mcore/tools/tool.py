"""Tools: Python functions a policy may call, each described by a JSON schema.

A tool is a plain function, sync or async, with type hints and a docstring whose `Args:`
section describes each argument; its schema comes from them (transformers'
`get_json_schema`, the convention chat templates' `tools=` argument expects)::

    def add(a: float, b: float) -> float:
        \"\"\"Add two numbers.

        Args:
            a: the first number
            b: the second number
        \"\"\"
        return a + b

    tools = [as_tool(add)]   # or load_tools("mypkg.tools:add,mypkg.tools:mul")
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tool:
    """A callable and its schema (`{"type": "function", "function": {"name", ...}}`)."""

    fn: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def argument_error(self, arguments: dict[str, Any]) -> str | None:
        """Why `arguments` cannot be passed to the tool (unknown or missing names), or None."""
        params = self.schema["function"].get("parameters", {})
        known = set(params.get("properties", {}))
        unknown = sorted(set(arguments) - known)
        missing = sorted(set(params.get("required", [])) - set(arguments))
        if unknown:
            return f"tool {self.name!r} has no argument {unknown[0]!r}; its arguments: {sorted(known)}"
        if missing:
            return f"tool {self.name!r} needs the argument {missing[0]!r}"
        return None


def as_tool(fn: Callable[..., Any] | Tool) -> Tool:
    """`fn` with its schema from its signature and docstring; a `Tool` is returned unchanged."""
    if isinstance(fn, Tool):
        return fn
    if not callable(fn):
        raise ValueError(f"a tool must be a function, got {type(fn).__name__}")
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers raises its own parsing exceptions, not ValueError
        name = getattr(fn, "__name__", repr(fn))
        raise ValueError(
            f"tool {name!r}: no JSON schema from its signature and docstring ({exc}); give every "
            "argument a type hint and describe it in an 'Args:' section of the docstring"
        ) from exc
    return Tool(fn=fn, schema=schema)


def as_tools(tools: Sequence[Callable[..., Any] | Tool]) -> list[Tool]:
    """Tools with distinct names, or a ValueError naming the repeated one."""
    out = [as_tool(t) for t in tools]
    names = [t.name for t in out]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"tool names must be distinct, {repeated[0]!r} appears {names.count(repeated[0])} times"
        )
    if not out:
        raise ValueError("no tools given")
    return out


def load_tools(spec: str | Sequence[str]) -> list[Tool]:
    """Tools named `MODULE:FN[,MODULE:FN...]` (what `--tools` takes), imported and described."""
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [s.strip() for s in spec]
    fns = []
    for item in items:
        module, sep, attr = item.partition(":")
        if not sep or not module or not attr:
            raise ValueError(
                f"tool {item!r}: expected MODULE:FN (e.g. interlens_mcore.tools.examples:calculator)"
            )
        try:
            fns.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"tool {item!r}: cannot import it ({exc})") from exc
    return as_tools(fns)
