"""Agents written against the OpenAI API, trained as they are: an OpenAI-compatible endpoint on
the rollout ranks (`server`), token-exact sessions (`session`), lockstep rounds over black-box
agents (`rounds`) and the task source of `--agent MODULE:FN` (`task`).

The names below are imported when first used, so reading `agents.defaults` (the command line
does) needs neither aiohttp nor openai."""

from importlib import import_module
from typing import Any

_WHERE = {
    "AgentEndpoint": "server",
    "DirectBatcher": "server",
    "serve": "server",
    "Session": "session",
    "AgentTasks": "task",
    "run_agents": "task",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_WHERE[name]}", __name__), name)
