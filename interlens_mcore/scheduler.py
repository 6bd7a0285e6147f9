"""The scheduler-facing API of multi-turn rollouts: requests, responses, outputs, schedulers.

`MultiTurnScheduler` mirrors ms-swift's names (`on_trajectory_start`, async `on_turn_end`,
`check_finished`, `step` returning `infer_request` and optional `response_token_ids`,
`response_loss_mask`, `rollout_logprobs`, `rollout_infos`), so a scheduler written for it
ports with little change. Unlike ms-swift, requests stay in token space: a request's
`prompt_ids` are exactly what the engine conditions on, and every next request must extend
the previous prompt + response, so the trajectory is, token for token, what the engine saw.
`EngineRollout` is the usual `rollout_fn` over an `Engine`. The driver that runs them,
`run_multi_turn`, is in multiturn.py.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .chat import ChatFormat
from .engine import Engine, SamplingParams
from .sampling import mix_seed
from .trajectory import Status, Trajectory, TurnSpan, complete_or_none


@dataclass(kw_only=True)
class MultiTurnRequest:
    """One conversation's next engine call, in token space."""

    index: int  # stable id over all ranks: names the request in errors and seeds its samples
    prompt_ids: list[int]  # exactly what the engine conditions on (ends with the assistant opener)
    messages: list[dict[str, str]] = field(default_factory=list)  # text transcript, for schedulers
    data: dict[str, Any] = field(default_factory=dict)  # free per-request state (answer, env config)
    turn: int = 1  # 1-based engine call this request asks for; the driver sets it

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.index}: prompt_ids is empty")

    @classmethod
    def from_messages(
        cls, chat: ChatFormat, messages: list[dict[str, str]], *, index: int, data: dict | None = None
    ) -> MultiTurnRequest:
        """Render every message once, then open the assistant's turn."""
        ids = [t for m in messages for t in chat.message_ids(m["role"], m["content"])]
        ids += chat.generation_prompt_ids()
        return cls(index=index, prompt_ids=ids, messages=[dict(m) for m in messages], data=data or {})


@dataclass(kw_only=True)
class ResponseChoice:
    """What the engine answered to one request: the choice a scheduler sees."""

    text: str
    token_ids: list[int]  # sampled ids, verbatim
    logprobs: list[float] | None  # one per sampled id; None when the engine gives none
    finish_reason: str  # "stop" | "length"


@dataclass(kw_only=True)
class RolloutOutput:
    """Everything one request produced, turn by turn."""

    request: MultiTurnRequest  # the last request; its messages end with the final reply
    prompt_ids: list[int]  # the first request's prompt: where the trajectory starts
    # per turn: ids appended since the previous turn (closing template ids, environment
    # messages and the assistant opener, all mask 0), then the turn's own response
    response_token_ids: list[list[int]] = field(default_factory=list)
    response_loss_mask: list[list[int]] = field(default_factory=list)
    rollout_logprobs: list[list[float] | None] = field(default_factory=list)  # one per mask-1 token
    rollout_infos: dict[str, Any] = field(default_factory=dict)  # hooks' and steps' infos, num_turns
    finish_reason: str | None = None  # the last response's
    status: Status = Status.RUNNING  # STOPPED, MAX_TURNS; FAILED for the request that failed
    error: str | None = None  # why it failed
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each response
    turn_finish_reasons: list[str] = field(default_factory=list)

    @property
    def num_turns(self) -> int:
        """Engine calls this request took; a continuation counts as a call of its own."""
        return int(self.rollout_infos.get("num_turns", 0))

    def to_trajectory(self, *, group: int = 0, participant: str = "policy") -> Trajectory:
        """The trajectory; rollout logprobs only if there is one per loss-mask-1 token.

        Incomplete logprobs are dropped, which turns IS correction off for this sample;
        `infos['logprobs_complete']` says so, so the trainer can count it.
        """
        ids = self.prompt_ids + [t for turn in self.response_token_ids for t in turn]
        mask = [0] * len(self.prompt_ids) + [m for turn in self.response_loss_mask for m in turn]
        # check turn by turn: a turn short of a logprob must not borrow a neighbour's surplus
        aligned = all(
            lp is not None and len(lp) == sum(m)
            for lp, m in zip(self.rollout_logprobs, self.response_loss_mask, strict=True)
        )
        flat = [x for lp in self.rollout_logprobs for x in lp] if aligned else None
        logprobs, complete = complete_or_none(flat, mask)
        spans = [
            TurnSpan(start=s, end=e, speaker=participant, trained=1 in mask[s:e], finish_reason=r)
            for (s, e), r in zip(self.spans, self.turn_finish_reasons, strict=True)
        ]
        infos = {**self.rollout_infos, "logprobs_complete": complete}
        return Trajectory(
            token_ids=ids,
            loss_mask=mask,
            rollout_logprobs=logprobs,
            turns=spans,
            participant=participant,
            group=group,
            status=self.status,
            infos=infos,
        )


class MultiTurnScheduler(ABC):
    """Decides when a request is finished and builds its next request.

    Example: a calculator tool that answers every turn until the policy says "done"::

        class Calculator(MultiTurnScheduler):
            async def on_turn_end(self, request, response_choice, current_turn):
                if "done" in response_choice.text:
                    return {"done": True, "rollout_infos": {"solved_at": current_turn}}
                return None

            def step(self, request, response_choice, current_turn):
                numbers = [int(w) for w in response_choice.text.split() if w.isdigit()]
                result = f"sum = {sum(numbers)}"
                return {"infer_request": self.reply(request, response_choice, result, role="tool")}

    `reply` closes the policy's turn, appends the tool message rendered once through the chat
    template and opens the next assistant turn, all in token space. Return
    `response_token_ids` / `response_loss_mask` (same length) / `rollout_logprobs` from `step`
    to change what the just-finished turn contributes (e.g. cut a reply at a stop string; pass
    the same ids to `reply(..., response_token_ids=...)`).
    Leave the last message as the assistant's (`continue_turn`) and the next engine call
    continues the same turn.
    """

    def __init__(self, chat: ChatFormat | None = None, max_turns: int | None = None):
        self.chat = chat  # needed by `reply` and `continue_turn`
        self.max_turns = max_turns

    def on_trajectory_start(self, requests: list[MultiTurnRequest]) -> None:
        """Called once with this rank's requests before the first turn's hooks."""

    async def on_turn_end(
        self, request: MultiTurnRequest, response_choice: ResponseChoice, current_turn: int
    ) -> dict[str, Any] | None:
        """Runs concurrently for all requests of a round; may return `done` and `rollout_infos`.

        A `done` that is not None decides instead of `check_finished`.
        """
        return None

    def check_finished(
        self, request: MultiTurnRequest, response_choice: ResponseChoice, current_turn: int
    ) -> bool:
        """Default: a reply cut at the token cap, or the scheduler's max_turns reached."""
        if response_choice.finish_reason == "length":
            return True
        return self.max_turns is not None and current_turn >= self.max_turns

    @abstractmethod
    def step(
        self, request: MultiTurnRequest, response_choice: ResponseChoice, current_turn: int
    ) -> dict[str, Any]:
        """Return {"infer_request": next request, ...optional turn overrides and rollout_infos}."""

    def _chat(self) -> ChatFormat:
        if self.chat is None:
            raise ValueError(f"{type(self).__name__}: reply/continue_turn need chat=ChatFormat(...)")
        return self.chat

    def reply(
        self,
        request: MultiTurnRequest,
        response_choice: ResponseChoice,
        content: str,
        *,
        role: str = "user",
        response_token_ids: list[int] | None = None,
    ) -> MultiTurnRequest:
        """Next request: this reply closed, a `role` message rendered once, an assistant opener."""
        chat = self._chat()
        ids = response_choice.token_ids if response_token_ids is None else response_token_ids
        # a reply that ended on its own stop token needs only the template's tail after it
        closed = bool(ids) and ids[-1] in chat.stop_token_ids
        prompt = request.prompt_ids + list(ids) + chat.close_ids("stop" if closed else "length")
        prompt += chat.message_ids(role, content) + chat.generation_prompt_ids()
        messages = request.messages + [{"role": role, "content": content}]
        return dataclasses.replace(request, prompt_ids=prompt, messages=messages)

    def continue_turn(
        self, request: MultiTurnRequest, response_choice: ResponseChoice, text: str = ""
    ) -> MultiTurnRequest:
        """Next request continues the assistant's message after `text` (tokens not trained)."""
        extra = self._chat().encode(text) if text else []
        messages = [dict(m) for m in request.messages]
        messages[-1]["content"] += text
        prompt = request.prompt_ids + response_choice.token_ids + extra
        return dataclasses.replace(request, prompt_ids=prompt, messages=messages)


class ToolScheduler(MultiTurnScheduler):
    """Answers every policy turn with `tool(reply_text)` as a `role` message.

    `done_when(reply_text)` true ends the request at that turn (and records `solved_turn`).
    """

    def __init__(
        self,
        chat: ChatFormat,
        tool: Callable[[str], str],
        *,
        role: str = "tool",
        done_when: Callable[[str], bool] | None = None,
        max_turns: int | None = None,
    ):
        super().__init__(chat, max_turns)
        self.tool, self.role, self.done_when = tool, role, done_when

    async def on_turn_end(self, request, response_choice, current_turn):
        if self.done_when is not None and self.done_when(response_choice.text):
            return {"done": True, "rollout_infos": {"solved_turn": current_turn}}
        return None

    def step(self, request, response_choice, current_turn):
        content = self.tool(response_choice.text)
        return {"infer_request": self.reply(request, response_choice, content, role=self.role)}


@dataclass
class EngineRollout:
    """A `rollout_fn` over an `Engine`: one generate call per round, seeds per (request, turn).

    The seed depends only on `seed`, the request's index and its turn, so a request's tokens
    do not depend on which other requests share the round.
    """

    engine: Engine
    chat: ChatFormat
    seed: int = 0

    def __call__(self, requests: Sequence[MultiTurnRequest], config: SamplingParams) -> list[ResponseChoice]:
        rows = [
            config.request(
                r.prompt_ids,
                seed=mix_seed(self.seed, r.index, r.turn),
                stop_token_ids=self.chat.stop_token_ids,
                tag=f"request {r.index}",
            )
            for r in requests
        ]
        # called with no rows too: a colocated engine's forward is a collective
        return [
            ResponseChoice(
                text=self.chat.decode(g.token_ids),
                token_ids=g.token_ids,
                logprobs=g.logprobs,
                finish_reason=g.finish_reason,
            )
            for g in self.engine.generate(rows)
        ]


RolloutFn = Callable[[list[MultiTurnRequest], Any], list[ResponseChoice]]
