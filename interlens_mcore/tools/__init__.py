"""Tool calling: Python functions as tools, call parsing, a tool-running participant.

`with_tools(source, tools)` offers tools to any task source's policy; `load_tools` reads the
`MODULE:FN,...` form of `--tools`; `examples` holds a calculator and a sandboxed evaluator.
Tools run in worker processes under `WorkerLimits` (`pool`), or in the trainer's process with
`isolation="thread"`. `trl_env` trains TRL's `environment_factory` classes, whose methods are
tools (`--environment-factory`).
"""

from .environment import TOOL_COUNTERS, ToolEnvironment, tool_metrics
from .parser import HermesParser, ParsedCalls, ToolCall, ToolCallParser
from .pool import WorkerLimits
from .render import plain_preamble, template_preamble, tools_system_text
from .sandbox import Sandbox, SandboxError, SandboxLimits
from .task import ToolOptions, ToolTask, ToolTaskSource, with_tools
from .tool import Tool, as_tool, as_tools, load_tools

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
