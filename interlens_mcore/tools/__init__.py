"""Tool calling: Python functions as tools, call parsing, a tool-running participant.

`with_tools(source, tools)` offers tools to any task source's policy; `load_tools` reads the
`MODULE:FN,...` form of `--tools`; `examples` holds a calculator and a sandboxed evaluator.
Tools run in worker processes under `WorkerLimits` (`pool`), or in the trainer's process with
`isolation="thread"`. `trl_env` trains TRL's `environment_factory` classes, whose methods are
tools (`--environment-factory`).

Names are imported on first use (PEP 562), as the package's own: a worker process that imports
a tool of this package (`interlens_mcore.tools.examples:calculator`) imports the tool's module
and what it needs, never torch (which the tool environment's rollout machinery pulls in), so it
starts in a fraction of a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports

# module (relative to this package) -> the public names it holds
_EXPORTS: dict[str, tuple[str, ...]] = {
    ".environment": ("TOOL_COUNTERS", "ToolEnvironment", "tool_metrics"),
    ".parser": ("HermesParser", "ParsedCalls", "ToolCall", "ToolCallParser"),
    ".pool": ("WorkerLimits",),
    ".render": ("plain_preamble", "template_preamble", "tools_system_text"),
    ".sandbox": ("Sandbox", "SandboxError", "SandboxLimits"),
    ".task": ("ToolOptions", "ToolTask", "ToolTaskSource", "with_tools"),
    ".tool": ("Tool", "as_tool", "as_tools", "load_tools"),
}

if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported eagerly
    from .environment import TOOL_COUNTERS, ToolEnvironment, tool_metrics
    from .parser import HermesParser, ParsedCalls, ToolCall, ToolCallParser
    from .pool import WorkerLimits
    from .render import plain_preamble, template_preamble, tools_system_text
    from .sandbox import Sandbox, SandboxError, SandboxLimits
    from .task import ToolOptions, ToolTask, ToolTaskSource, with_tools
    from .tool import Tool, as_tool, as_tools, load_tools


__getattr__, __dir__ = exports(__name__, _EXPORTS, globals())

__all__ = [
    "TOOL_COUNTERS",
    "HermesParser",
    "ParsedCalls",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolEnvironment",
    "ToolOptions",
    "ToolTask",
    "ToolTaskSource",
    "WorkerLimits",
    "as_tool",
    "as_tools",
    "load_tools",
    "plain_preamble",
    "template_preamble",
    "tool_metrics",
    "tools_system_text",
    "with_tools",
]
