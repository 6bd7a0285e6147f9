"""The defaults of `--agent` and the agent API, in one place (the CLI reads them from here)."""

from __future__ import annotations

from typing import Literal

Branches = Literal["last", "all"]
# how a re-sent reply is recognised: its text must be the one returned ("text"), or any
# assistant message where a sampled reply stood is taken for it ("position": for frameworks
# that re-render replies in their own words, e.g. smolagents' "Calling tools: [...]")
ReplyMatch = Literal["text", "position"]

BRANCHES: Branches = "last"  # train the session's last call's history
REPLY_MATCH: ReplyMatch = "text"
ROUND_WAIT_S = 2.0  # how long a round waits for a busy agent to call before it generates
