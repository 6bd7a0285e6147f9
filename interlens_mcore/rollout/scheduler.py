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

from ..chat import ChatFormat
from ..engines.base import Engine, SamplingParams, check_temperature
from ..engines.sampler import mix_seed
from ..types import Status, TrainTurns, Trajectory, TrajectoryInfo, TurnTokens, assemble, logprobs_fit
from .outcome import Room
from .vote import RolloutError, RolloutValueError


@dataclass(kw_only=True)
class MultiTurnRequest:
    """One conversation's next engine call, in token space."""

    index: int  # stable id over all ranks: names the request in errors and seeds its samples
    # the sample's random stream (a rollouter's row expansion sets it); None: seeded by `index`
    seed: int | None = None
    prompt_ids: list[int]  # exactly what the engine conditions on (ends with the assistant opener)
    messages: list[dict[str, str]] = field(default_factory=list)  # text transcript, for schedulers
    data: dict[str, Any] = field(default_factory=dict)  # free per-request state (answer, env config)
    turn: int = 1  # 1-based engine call this request asks for; the driver sets it
    # set by reply()/continue_turn(): (ids, loss mask) the just-finished turn contributes
    response: tuple[list[int], list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.index}: prompt_ids is empty")

    @classmethod
    def from_messages(
        cls,
        chat: ChatFormat,
        messages: list[dict[str, str]],
        *,
        index: int,
        data: dict[str, Any] | None = None,
        seed: int | None = None,
    ) -> MultiTurnRequest:
        """Render every message once, then open the assistant's turn.

        A last message of role assistant is a prefill: the turn opens with its text and the
        engine continues that message (one assistant message, in the messages and the tokens).
        """
        prefill = bool(messages) and messages[-1]["role"] == "assistant"
        head = messages[:-1] if prefill else messages
        # with no message before it, the assistant's turn opens the conversation and gets the
        # template's preamble (a default system block)
        opening = chat.conversation_ids(head) if head else chat.preamble_ids("assistant")
        ids = opening + chat.generation_prompt_ids()
        if prefill:
            ids += chat.encode_text(messages[-1]["content"])
        return cls(
            index=index, seed=seed, prompt_ids=ids, messages=[dict(m) for m in messages], data=data or {}
        )


@dataclass(kw_only=True)
class ResponseChoice:
    """What the engine answered to one request: the choice a scheduler sees."""

    text: str
    token_ids: list[int]  # sampled ids, verbatim
    logprobs: list[float] | None  # one per sampled id; None when the engine gives none
    finish_reason: str  # "stop" | "length"
    truncated: bool = False  # the engine's context cut (or left no room for) it: the request ends


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
    train_turns: TrainTurns = "all"  # which turns to_trajectory trains (ms-swift's loss_scale)
    # tokens the engine saw, set when the last request did not fit the context (TRUNCATED): what
    # its prompt gained since the turn before was never conditioned on
    seen: int | None = None

    @property
    def num_turns(self) -> int:
        """Engine calls this request took; a continuation counts as a call of its own."""
        return int(self.rollout_infos.get("num_turns", 0))

    def add_turn(
        self,
        request: MultiTurnRequest,
        ids: list[int],
        mask: list[int],
        logprobs: list[float] | None,
        choice: ResponseChoice,
        continuing: bool,
    ) -> None:
        """Record the response to `request` after whatever its prompt gained since the last
        turn; a continuation extends the last turn instead of starting one."""
        covered = len(self.prompt_ids) + sum(len(t) for t in self.response_token_ids)
        context = request.prompt_ids[covered:]  # template/environment ids, never trained
        finish_reason = choice.finish_reason
        start = covered + len(context)
        if continuing and self.response_token_ids:
            last = self.rollout_logprobs[-1]
            # each piece must match its own mask: a piece one short and the next one long would
            # sum to the right count and shift every logprob of the turn by one token
            fits = logprobs_fit(last, self.response_loss_mask[-1]) and logprobs_fit(logprobs, mask)
            self.response_token_ids[-1] += context + ids
            self.response_loss_mask[-1] += [0] * len(context) + mask
            joined = (last or []) + (logprobs or [])
            # a misfit must stay a misfit: a joined list that happens to fit (one piece short, the
            # next long) becomes None, which cannot fit, as the turn then trains >= 1 token
            misfit = joined if len(joined) != sum(self.response_loss_mask[-1]) else None
            self.rollout_logprobs[-1] = joined if fits else misfit
            self.spans[-1] = (self.spans[-1][0], start + len(ids))
            self.turn_finish_reasons[-1] = finish_reason
        else:
            self.response_token_ids.append(context + ids)
            self.response_loss_mask.append([0] * len(context) + mask)
            self.rollout_logprobs.append(None if logprobs is None else list(logprobs))
            self.spans.append((start, start + len(ids)))
            self.turn_finish_reasons.append(finish_reason)
        self.finish_reason = finish_reason
        self.rollout_infos["num_turns"] = request.turn

    def to_trajectory(
        self, *, group: int = 0, participant: str = "policy", train_turns: TrainTurns | None = None
    ) -> Trajectory:
        """The trajectory; rollout logprobs only if there is one per loss-mask-1 token.

        `train_turns` (default: the run's) picks the trained turns: "all", the "last", or
        one bool per turn. Incomplete logprobs are dropped, which turns IS correction off for
        this sample; `infos.logprobs_complete` says so, so the trainer can count it. The
        infos hold the request's index, seed, turn count and a failed request's `error` as
        `stop_reason`; every other `rollout_infos` key
        (a timeout's message, the scheduler's reward) is in `infos.extra`.
        """
        ids = self.prompt_ids + [t for turn in self.response_token_ids for t in turn]
        turns = [
            # a turn's own tokens are the tail of its piece: the piece opens with context ids
            TurnTokens(start=s, mask=piece[len(piece) - (e - s) :], logprobs=lp, finish_reason=r)
            for (s, e), piece, lp, r in zip(
                self.spans,
                self.response_loss_mask,
                self.rollout_logprobs,
                self.turn_finish_reasons,
                strict=True,
            )
        ]
        if self.seen is not None:  # nothing past what the engine saw (it would not fit the context)
            ids = ids[: self.seen]
            turns = [_clamped(t, self.seen) for t in turns]
        return assemble(
            ids,
            turns,
            train=self.train_turns if train_turns is None else train_turns,
            participant=participant,
            group=group,
            status=self.status,
            infos=TrajectoryInfo(
                index=self.request.index,
                seed=self.request.seed,
                turns=self.num_turns,
                stop_reason=self.error,  # a failed request's cause ("scheduler: KeyError: ...")
                extra=TrajectoryInfo.split({k: v for k, v in self.rollout_infos.items() if k != "num_turns"}),
            ),
        )


class MultiTurnError(RolloutError):
    """A failed rollout that keeps this rank's work: `outputs`, one per request, in order.

    Finished requests keep their status; unfinished ones are RUNNING with the turns they had;
    a request that failed is FAILED with its `error`.
    """

    def __init__(self, failures: list[tuple[int, str]], outputs: list[RolloutOutput]):
        super().__init__(failures)
        self.outputs = outputs


class MultiTurnValueError(MultiTurnError, RolloutValueError):
    """Bad input (a ValueError) on every failing rank."""


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
    continues the same turn. `before_first_turn` (sync or async) may rewrite the requests
    before the first engine call (e.g. reset an environment and show its first observation);
    the caller runs it with `prepare_requests`.
    """

    def __init__(self, chat: ChatFormat | None = None, max_turns: int | None = None):
        self.chat = chat  # needed by `reply` and `continue_turn`
        self.max_turns = max_turns

    def before_first_turn(self, requests: list[MultiTurnRequest]) -> list[MultiTurnRequest]:
        """Before the first engine call (sync or `async def`): may rewrite the requests, e.g.
        reset an environment and put its first observation into the prompt.

        The caller of `run_multi_turn` runs it, through `prepare_requests(scheduler, requests)`,
        since it generates the first turn; return one request per request, same indices.
        """
        return requests

    def on_trajectory_start(self, requests: list[MultiTurnRequest]) -> None:
        """Called once with this rank's requests before the first turn's hooks."""

    async def on_turn_end(
        self, request: MultiTurnRequest, response_choice: ResponseChoice, current_turn: int
    ) -> dict[str, object] | None:
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
    ) -> dict[str, object]:
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
        response_loss_mask: list[int] | None = None,
    ) -> MultiTurnRequest:
        """Next request: this reply closed, a `role` message rendered once, an assistant opener.

        `response_token_ids` / `response_loss_mask` replace what the turn contributes (e.g. a
        reply cut at a stop string); the driver records them unless the step says otherwise.
        """
        chat = self._chat()
        ids, response = _response(request, response_choice, response_token_ids, response_loss_mask)
        # a reply that ended on its own stop token needs only the template's tail after it
        closed = bool(ids) and ids[-1] in chat.stop_token_ids
        prompt = request.prompt_ids + list(ids) + chat.close_ids("stop" if closed else "length")
        prompt += chat.message_ids(role, content) + chat.generation_prompt_ids()
        messages = request.messages + [{"role": role, "content": content}]
        return dataclasses.replace(request, prompt_ids=prompt, messages=messages, response=response)

    def continue_turn(
        self,
        request: MultiTurnRequest,
        response_choice: ResponseChoice,
        text: str = "",
        *,
        response_token_ids: list[int] | None = None,
        response_loss_mask: list[int] | None = None,
    ) -> MultiTurnRequest:
        """Next request continues the assistant's message after `text` (tokens not trained).

        `response_token_ids` / `response_loss_mask` as for `reply`.
        """
        extra = self._chat().encode_text(text) if text else []
        ids, response = _response(request, response_choice, response_token_ids, response_loss_mask)
        messages = [dict(m) for m in request.messages]
        messages[-1]["content"] += text
        prompt = request.prompt_ids + list(ids) + extra
        return dataclasses.replace(request, prompt_ids=prompt, messages=messages, response=response)


def _clamped(turn: TurnTokens, end: int) -> TurnTokens:
    """`turn` without its tokens at or past `end` (only context ids, mask 0, are ever cut)."""
    start = min(turn.start, end)
    mask = turn.mask[: end - start]
    assert sum(mask) == sum(turn.mask), "a sampled token lies past what the engine saw"
    return dataclasses.replace(turn, start=start, mask=mask)


def _response(request, choice, ids, mask) -> tuple[list[int], tuple[list[int], list[int]] | None]:
    """The ids a turn contributes and the override to record, checked against each other."""
    if ids is None and mask is None:
        return list(choice.token_ids), None
    ids = list(choice.token_ids) if ids is None else list(ids)
    mask = [1] * len(ids) if mask is None else list(mask)
    if len(mask) != len(ids):
        raise ValueError(
            f"request {request.index}: response_loss_mask has {len(mask)} entries but "
            f"response_token_ids has {len(ids)}"
        )
    return ids, (ids, mask)


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

    The seed depends only on `seed`, the request's own seed (its index when it has none) and
    its turn, so a request's tokens do not depend on which other requests share the round.
    """

    engine: Engine
    chat: ChatFormat
    seed: int = 0

    def __call__(self, requests: Sequence[MultiTurnRequest], config: SamplingParams) -> list[ResponseChoice]:
        """One choice per request; a request the context cannot hold gets an empty truncated one."""
        check_temperature(config.temperature, "EngineRollout")
        room = [Room.after(len(r.prompt_ids), self.engine.max_context) for r in requests]
        fits = [i for i in range(len(requests)) if room[i].fits]
        rows = [
            config.request(
                requests[i].prompt_ids,
                seed=mix_seed(self.seed, _stream(requests[i]), requests[i].turn),
                max_new_tokens=room[i].budget(config.max_new_tokens),
                stop_token_ids=self.chat.stop_token_ids,
                tag=f"request {requests[i].index}",
            )
            for i in fits
        ]
        # called with no rows too: a colocated engine's forward is a collective
        made = dict(zip(fits, self.engine.generate(rows), strict=True))
        out = []
        for i in range(len(requests)):
            g = made.get(i)
            ids = [] if g is None else g.token_ids
            out.append(
                ResponseChoice(
                    text=self.chat.decode(ids),
                    token_ids=ids,
                    logprobs=[] if g is None else g.logprobs,
                    finish_reason="length" if g is None else g.finish_reason,
                    # the reply filled the context, not its own cap: there is no next turn
                    truncated=room[i].filled(len(ids), config.max_new_tokens),
                )
            )
        return out


def _stream(request: MultiTurnRequest) -> int:
    return request.index if request.seed is None else request.seed


RolloutFn = Callable[[list[MultiTurnRequest], SamplingParams], list[ResponseChoice]]
