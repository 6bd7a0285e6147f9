"""Agents written against the OpenAI API, trained as they are: an OpenAI-compatible endpoint on
the rollout ranks (`server`), token-exact sessions (`session`), lockstep rounds over black-box
agents (`rounds`) and the task source of `--agent MODULE:FN` (`task`)."""

from .server import AgentEndpoint, DirectBatcher, serve
from .session import Session
from .task import AgentTasks, run_agents

__all__ = ["AgentEndpoint", "AgentTasks", "DirectBatcher", "Session", "run_agents", "serve"]
