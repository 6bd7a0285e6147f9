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

A tool runs in a worker process (`pool`), which imports it by its `reference`,
`MODULE:QUALNAME`: so a tool defined at the top level of a module runs there, and one that is
not importable that way (a closure, a lambda, a `functools.partial`, a function of the script
being run, `__main__`) has no reference, and runs only in the trainer's process
(`isolation="thread"`, see `environment`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict, cast


class ToolParameters(TypedDict, total=False):
    """The JSON schema of a tool's keyword arguments."""

    type: str
    properties: dict[str, dict[str, object]]  # argument name -> its JSON schema
    required: list[str]


class _NamedFunction(TypedDict):
    name: str


class ToolFunction(_NamedFunction, total=False):
    description: str
    parameters: ToolParameters
    returns: dict[str, object]


class ToolSchema(TypedDict):
    """`{"type": "function", "function": {"name", "description", "parameters"}}`."""

    type: str
    function: ToolFunction


@dataclass(frozen=True)
class Tool:
    """A callable and its schema (`{"type": "function", "function": {"name", ...}}`)."""

    fn: Callable[..., object]
    schema: ToolSchema
    reference: str | None = None  # `MODULE:QUALNAME` a worker imports it by; None if not importable

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def argument_error(self, arguments: Mapping[str, object]) -> str | None:
        """Why `arguments` cannot be passed to the tool (unknown or missing names), or None."""
        params = self.schema["function"].get("parameters", ToolParameters())
        known = set(params.get("properties", {}))
        unknown = sorted(set(arguments) - known)
        missing = sorted(set(params.get("required", [])) - set(arguments))
        if unknown:
            return f"tool {self.name!r} has no argument {unknown[0]!r}; its arguments: {sorted(known)}"
        if missing:
            return f"tool {self.name!r} needs the argument {missing[0]!r}"
        return None


def reference_of(fn: Callable[..., object]) -> tuple[str | None, str]:
    """(`MODULE:QUALNAME`, "") if importing that name gives `fn` back, else (None, why not)."""
    if not (inspect.isfunction(fn) or inspect.isbuiltin(fn)):
        return None, f"it is a {type(fn).__name__}, not a function"
    module, qualname = fn.__module__, fn.__qualname__
    if "<locals>" in qualname or qualname == "<lambda>":
        return None, "it is a lambda or is defined inside a function"
    if module == "__main__" or module not in sys.modules:
        return None, f"it is defined in {module!r}, the script being run, not in an importable module"
    obj: object = sys.modules[module]
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is not fn:
        return None, f"{module}:{qualname} names another object"
    return f"{module}:{qualname}", ""


def as_tool(fn: Callable[..., object] | Tool) -> Tool:
    """`fn` with its schema from its signature and docstring; a `Tool` as it is (with its
    function's reference if it was made without one)."""
    if isinstance(fn, Tool):
        if fn.reference is None:
            return dataclasses.replace(fn, reference=reference_of(fn.fn)[0])
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
    # transformers builds the schema of the form ToolSchema declares
    return Tool(fn=fn, schema=cast(ToolSchema, schema), reference=reference_of(fn)[0])


def as_tools(tools: Sequence[Callable[..., object] | Tool]) -> list[Tool]:
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
    """Tools named `MODULE:FN[,MODULE:FN...]` (what `--tools` takes), imported and described.

    A name may hold a list (or tuple) of functions, as a TRL user passes `tools=[fn, ...]`:
    `MODULE:TOOLS` gives each of them.
    """
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [s.strip() for s in spec]
    tools: list[Tool] = []
    for item in items:
        module, sep, attr = item.partition(":")
        if not sep or not module or not attr:
            raise ValueError(
                f"tool {item!r}: expected MODULE:FN (e.g. interlens_mcore.tools.examples:calculator)"
            )
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"tool {item!r}: cannot import it ({exc})") from exc
        if isinstance(fn, (list, tuple)):
            tools += [as_tool(f) for f in fn]  # each importable by its own name, or run in-process
            continue
        tool = as_tool(fn)
        if tool.reference is None and module != "__main__":  # a callable object, imported by this name
            tool = dataclasses.replace(tool, reference=f"{module}:{attr}")
        tools.append(tool)
    return as_tools(tools)
