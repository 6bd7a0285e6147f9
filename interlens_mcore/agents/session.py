"""Token-exact agent sessions: what one agent run sent and was sampled, in token space.

An agent framework re-sends its whole history with every call. Re-rendering that history
would give other ids than the engine sampled (a re-tokenized reply, a template that edits
what it renders), and the trainer would then learn on a sequence no engine ever saw. A
session instead keeps, for every call it answered, a `Node`: the canonical messages of the
history (the reply included, as it was returned) and the exact ids behind them (the sampled
ids verbatim). A new call whose messages start with a node's messages is that node's ids
plus the rendering of the new messages only. A call that extends no node (the agent
rewrote, summarised or cut its history, or changed its tools) is rendered afresh: a new
branch of the session, counted, with the place its history departed from the last one.

Every sampled reply becomes a turn (assistant opener mask 0, sampled ids mask 1 with their
rollout logprobs); every rendered message is mask 0. A node that no later call extended is a
leaf; the session ends as the trajectory of its last node (`last`) or one per leaf (`all`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from ..chat import ChatFormat
from ..tools.render import tools_system_text
from ..types import TurnTokens
from .defaults import REPLY_MATCH, Branches, ReplyMatch


class Renderer:
    """Chat messages into ids, one message at a time (`ChatFormat.message_ids`), tools folded
    into the system message as the tool layer presents them (`tools_system_text`)."""

    def __init__(self, chat: ChatFormat):
        self.chat = chat
        self._tools: dict[tuple[str, str | None], str] = {}

    def _tools_text(self, tools: Sequence[Mapping[str, Any]], key: str, system: str | None) -> str:
        if (key, system) not in self._tools:
            tokenizer: Any = self.chat.tokenizer
            self._tools[(key, system)] = tools_system_text(
                tokenizer, [cast(Any, dict(t)) for t in tools], system
            )
        return self._tools[(key, system)]

    def opening(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], key: str
    ) -> list[int]:
        """Ids of a history rendered from its start (the template's preamble included)."""
        msgs = [dict(m) for m in messages]
        if key:
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {"role": "system", "content": self._tools_text(tools, key, msgs[0]["content"])}
            else:
                msgs.insert(0, {"role": "system", "content": self._tools_text(tools, key, None)})
        if not msgs:
            return []
        return self.chat.preamble_ids(msgs[0]["role"]) + self.messages(msgs)

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Ids of messages appended inside a conversation."""
        ids: list[int] = []
        for m in messages:
            ids += self.chat.message_ids(m["role"], written(m))
        return ids


def written(message: Mapping[str, Any]) -> str:
    """A message's text as the model writes it: an assistant's tool calls as Hermes blocks."""
    text = str(message.get("content") or "")
    calls = message.get("tool_calls") or []
    blocks = [
        "<tool_call>" + json.dumps({"name": c["name"], "arguments": c["arguments"]}) + "</tool_call>"
        for c in calls
    ]
    return "\n".join([text, *blocks]) if text and blocks else text + "\n".join(blocks)


@dataclass(eq=False)
class Node:
    """The state after one answered call: the history and its exact ids."""

    ids: list[int]
    turns: list[TurnTokens]
    messages: tuple[Mapping[str, Any], ...] | None  # canonical history (None: a completions node)
    tools_key: str = ""
    replies: frozenset[int] = frozenset()  # indices of `messages` that are sampled replies
    extended: bool = False  # a later call continued it


@dataclass
class Session:
    """One agent run's calls (see the module docstring)."""

    id: str
    seed: int = 0
    reply_match: ReplyMatch = REPLY_MATCH
    nodes: list[Node] = field(default_factory=list)
    calls: int = 0  # requests answered
    branches: int = 0  # requests that extended no leaf: a rewritten or forked history
    departures: list[str] = field(default_factory=list)  # where each branch left the last history
    truncated: bool = False  # a call did not fit the engine's context

    # -- finding what a call extends ----------------------------------------------------------
    def base_for_chat(self, messages: Sequence[Mapping[str, Any]], tools_key: str) -> Node | None:
        """The node with the longest history that `messages` start with (the newest of equals)."""
        best: Node | None = None
        for node in self.nodes:
            m = node.messages
            if m is None or node.tools_key != tools_key or len(m) > len(messages):
                continue
            if self._same(node, messages) and (best is None or len(m) >= len(best.messages or ())):
                best = node
        return best

    def _same(self, node: Node, messages: Sequence[Mapping[str, Any]]) -> bool:
        """Do `messages` start with `node`'s history (its replies matched per `reply_match`)?"""
        assert node.messages is not None
        for i, (mine, theirs) in enumerate(zip(node.messages, messages)):
            if mine == theirs:
                continue
            if not (
                self.reply_match == "position" and i in node.replies and theirs.get("role") == "assistant"
            ):
                return False
        return True

    def base_for_ids(self, prompt: Sequence[int]) -> Node | None:
        """The node with the longest ids that `prompt` starts with (token-in completions)."""
        best: Node | None = None
        for node in self.nodes:
            n = len(node.ids)
            if n <= len(prompt) and list(prompt[:n]) == node.ids and (best is None or n >= len(best.ids)):
                best = node
        return best

    def note_base(self, base: Node | None, messages: Sequence[Mapping[str, Any]] | None) -> None:
        """Count a call that extends no leaf as a new branch, saying where it departed."""
        if not self.nodes or (base is not None and not base.extended):
            return
        self.branches += 1
        last = self.nodes[-1].messages
        if base is not None:
            self.departures.append(f"call {self.calls + 1} continued an earlier call's reply (a fork)")
        elif last is not None and messages is not None:
            k = next(
                (i for i, (a, b) in enumerate(zip(last, messages)) if a != b), min(len(last), len(messages))
            )
            self.departures.append(f"call {self.calls + 1} rewrote the history at message {k}")
        else:
            self.departures.append(f"call {self.calls + 1} started a new prompt")

    # -- recording a call ---------------------------------------------------------------------
    def commit(
        self,
        base: Node | None,
        context: list[int],
        opener: list[int],
        sampled: Sequence[int],
        logprobs: Sequence[float],
        finish_reason: str,
        close: list[int],
        messages: tuple[Mapping[str, Any], ...] | None,
        tools_key: str,
    ) -> Node:
        """A new node: `context` (the history's ids), then the turn (`opener` mask 0, the sampled
        ids mask 1), then `close` (the template's end of the turn, mask 0)."""
        turn = TurnTokens(
            start=len(context),
            mask=[0] * len(opener) + [1] * len(sampled),
            logprobs=list(logprobs),
            finish_reason=finish_reason,
        )
        replies = base.replies if base is not None else frozenset()
        node = Node(
            ids=context + opener + list(sampled) + close,
            turns=[*(base.turns if base is not None else []), turn],
            messages=messages,
            tools_key=tools_key,
            replies=replies | {len(messages) - 1} if messages else replies,
        )
        if base is not None:
            base.extended = True
        self.nodes.append(node)
        return node

    def finals(self, branches: Branches) -> list[Node]:
        """The nodes that become trajectories: the last one, or every leaf in call order."""
        if not self.nodes:
            return []
        if branches == "last":
            return [self.nodes[-1]]
        return [n for n in self.nodes if not n.extended]
