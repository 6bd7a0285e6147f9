"""`SwiftBridge`: an ms-swift scheduler seen through the native `MultiTurnScheduler` API.

The native driver (`run_multi_turn`) calls the bridge's hooks; the bridge keeps each
request's ms-swift view (`RolloutInferRequest`, messages as text), calls the ms-swift
scheduler with ms-swift's meaning, and answers the driver in token space:

- `on_turn_end` appends the reply to the ms-swift messages (ms-swift's rule: it continues a
  last assistant message, after dropping a `content: None` placeholder), snapshots them and
  awaits the scheduler's hook; it never returns `done` to the driver;
- `check_finished`, on its first call of a round, runs the scheduler's `check_finished` for
  every request whose hook returned, in request order (ms-swift calls it after all hooks,
  also when the hook returned `done`), then decides: the hook's `done` if it has the key
  (None is "not done"; numpy bools count), else `check_finished`; and the turn cap;
- `step` runs the scheduler's step and turns the messages it appended into ids
  (transcript.py); step logprobs that are empty or None fall back to the engine's.

A step that rewrites history the engine already saw (`HistoryRewriteError`: ms-swift's
MathTipsScheduler does on an empty reply) fails only its own request under
`on_sample_error="skip"` (the trainer's default; "raise" raises it): the request is marked
failed (`RequestState.failed`, `"scheduler: HistoryRewriteError: ..."`), takes no more of the
scheduler's hooks and finishes at the next round; the compat driver gives it status FAILED.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ... import ChatFormat, MultiTurnRequest, ResponseChoice
from ... import MultiTurnScheduler as NativeScheduler
from ...rollout.limits import maybe_await
from ...rollout.outcome import OnSampleError
from ...types import validate_tokens
from .scheduler import MultiTurnScheduler
from .transcript import (
    HistoryRewriteError,
    append_completion,
    extension,
    native_messages,
    without_placeholder,
)
from .types import ChatCompletionResponseChoice, Message, RolloutInferRequest

T = TypeVar("T")

STEP_KEYS = ("infer_request", "response_token_ids", "response_loss_mask", "rollout_logprobs", "rollout_infos")
TURN_END_KEYS = ("done", "rollout_infos", "response_token_ids", "response_loss_mask", "rollout_logprobs")
OVERRIDE_KEYS = ("response_token_ids", "response_loss_mask", "rollout_logprobs")


def add_note(exc: BaseException, note: str) -> None:
    """Exception notes (PEP 678): printed under the traceback from Python 3.11 on."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:  # kept where 3.11 would keep it, for code that reads __notes__
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]


@dataclass
class RequestState:
    """The ms-swift view of one request, and what the bridge decided for it."""

    request: RolloutInferRequest
    index: int  # the native request index
    position: int  # order among this rank's requests: check_finished runs in this order
    group: int
    seed: int | None = None  # the sample's random stream; None: seeded by the index
    choice: ChatCompletionResponseChoice | None = None
    snapshot: list[Message] = field(default_factory=list)  # messages right after the reply
    turn_result: dict[str, Any] = field(default_factory=dict)  # on_turn_end's, this round
    by_cap: bool = False  # finished by the turn cap alone
    final: tuple[list[int], list[int], list[float] | None] | None = None  # on_turn_end's last turn
    failed: str | None = None  # why the scheduler failed this request alone ("scheduler: ...")

    def where(self, turn: int) -> str:
        return f"request {self.request.uuid} (index {self.index}, turn {turn})"

    @property
    def reply(self) -> ChatCompletionResponseChoice:
        """This turn's reply: on_turn_end sets `choice` before anything reads it."""
        assert self.choice is not None, "a request's reply is read only after its on_turn_end"
        return self.choice


def truthy_done(value: object, where: str) -> bool:
    """ms-swift tests `done` for truth: None is not done, numpy bools count; text is a mistake."""
    if isinstance(value, (str, bytes, list, tuple, dict, set)):
        raise ValueError(f"{where}: on_turn_end 'done' must be a bool or None, got {value!r}")
    return bool(value)


def _keys(result: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in result if k not in allowed)
    if unknown:
        raise ValueError(f"{where} returned unknown key(s) {unknown}; expected some of {list(allowed)}")


def _ids(value: object, where: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(type(t) is int for t in value):
        raise ValueError(f"{where} must be a list of int token ids, got {value!r}")
    return list(value)


def turn_overrides(result: dict, sampled: list[int], engine_logprobs: list[float] | None, where: str):
    """(ids, mask, logprobs) of a turn as the scheduler shaped it, with ms-swift's defaults.

    Missing ids are the sampled ones; a missing mask trains every id; logprobs that are empty
    or None are the engine's, unless the turn trains no token (then none are needed).
    """
    given = result.get("response_token_ids")
    ids = list(sampled) if given is None else _ids(given, f"{where} response_token_ids")
    mask = result.get("response_loss_mask")
    mask = [1] * len(ids) if mask is None else _ids(mask, f"{where} response_loss_mask")
    logprobs = result.get("rollout_logprobs")
    if not logprobs:
        logprobs = [] if sum(mask) == 0 else engine_logprobs
    elif isinstance(logprobs, (list, tuple)):
        logprobs = [float(x) for x in logprobs]
    else:
        raise ValueError(f"{where} rollout_logprobs must be a list of floats, got {type(logprobs).__name__}")
    return ids, mask, logprobs, given is not None


class SwiftBridge(NativeScheduler):
    """Adapts an ms-swift `MultiTurnScheduler` to the native driver (see the module docstring)."""

    chat: ChatFormat  # always given (a native scheduler's may be None)

    def __init__(
        self,
        scheduler: MultiTurnScheduler,
        chat: ChatFormat,
        states: list[RequestState],
        cap: int | None,
        *,
        on_sample_error: OnSampleError = "raise",
    ):
        super().__init__(chat, cap)
        self.user, self.cap, self.on_sample_error = scheduler, cap, on_sample_error
        self.states = {s.index: s for s in states}
        self.user_errors: list[BaseException] = []  # raised by the scheduler's own code
        self._hooked: dict[int, list[int]] = {}  # turn -> indices whose on_turn_end returned
        self._decided: dict[int, dict[int, bool]] = {}  # turn -> index -> finished

    def own(self, exc: BaseException | None) -> BaseException | None:
        """`exc` if the scheduler's code raised it (its type is the user's), else None."""
        return exc if exc is not None and any(e is exc for e in self.user_errors) else None

    def _failed(self, exc: BaseException, hook: str, st: RequestState, turn: int) -> None:
        add_note(exc, f"raised by {type(self.user).__name__}.{hook} for {st.where(turn)}")
        self.user_errors.append(exc)

    def _call(self, hook: str, st: RequestState, turn: int, fn: Callable[..., T], *args: object) -> T:
        try:
            return fn(*args)
        except Exception as exc:
            self._failed(exc, hook, st, turn)
            raise

    async def on_turn_end(
        self, request: MultiTurnRequest, response_choice: ResponseChoice, current_turn: int
    ):
        st = self.states[request.index]
        if st.failed is not None:  # its history is not the engine's any more: no hook sees it
            self._hooked.setdefault(current_turn, []).append(request.index)
            return None
        st.choice = ChatCompletionResponseChoice.from_native(response_choice, self.chat.tokenizer)
        append_completion(st.request.messages, response_choice.text)
        st.snapshot = copy.deepcopy(st.request.messages)
        try:
            result = await maybe_await(self.user.on_turn_end(st.request, st.choice, current_turn))
        except Exception as exc:
            self._failed(exc, "on_turn_end", st, current_turn)
            raise
        where = f"{st.where(current_turn)}: on_turn_end"
        result = {} if result is None else result
        if not isinstance(result, dict):
            raise ValueError(f"{where} must return a dict, got {result!r}")
        _keys(result, TURN_END_KEYS, where)
        st.turn_result = result
        self._hooked.setdefault(current_turn, []).append(request.index)
        infos = result.get("rollout_infos")
        return {"rollout_infos": infos} if infos else None

    def check_finished(
        self, request: MultiTurnRequest, response_choice: ResponseChoice, current_turn: int
    ) -> bool:
        if current_turn not in self._decided:
            self._decide(current_turn)
        # a request left undecided because another's check_finished raised: the rollout fails anyway
        return self._decided[current_turn].get(request.index, True)

    def _decide(self, turn: int) -> None:
        decided = self._decided[turn] = {}
        order = sorted(self._hooked.get(turn, []), key=lambda i: self.states[i].position)
        for index in order:
            st = self.states[index]
            if st.failed is not None:
                decided[index] = True
                continue
            checked = self._call(
                "check_finished", st, turn, self.user.check_finished, st.request, st.choice, turn
            )
            result = st.turn_result
            done = "done" in result
            stop = truthy_done(result["done"], st.where(turn)) if done else bool(checked)
            st.by_cap = not stop and self.cap is not None and turn >= self.cap
            decided[index] = stop or st.by_cap
            if decided[index] and any(result.get(k) is not None for k in OVERRIDE_KEYS):
                # checked here, inside the round, so bad ids fail every rank through the vote
                st.final = self._final_turn(st, turn)

    def _final_turn(self, st: RequestState, turn: int) -> tuple[list[int], list[int], list[float] | None]:
        """The finishing turn as on_turn_end shaped it (no step runs for it, in ms-swift either)."""
        where = f"{st.where(turn)}: on_turn_end"
        choice = st.reply
        engine = [float(x["logprob"]) for x in choice.logprobs["content"]] if choice.logprobs else None
        ids, mask, logprobs, _ = turn_overrides(st.turn_result, choice.token_ids, engine, where)
        validate_tokens(ids, mask, logprobs, where=where)
        size, sampled = len(self.chat.tokenizer), set(choice.token_ids)
        bad = next((t for t in ids if t >= size and t not in sampled), None)
        if bad is not None:
            raise ValueError(f"{where} response_token_ids holds {bad}, outside the vocabulary of {size}")
        return ids, mask, logprobs

    def step(self, request: MultiTurnRequest, response_choice: ResponseChoice, current_turn: int):
        st = self.states[request.index]
        where = f"{st.where(current_turn)}: step()"
        result = self._call("step", st, current_turn, self.user.step, st.request, st.choice, current_turn)
        if not isinstance(result, dict) or not isinstance(result.get("infer_request"), RolloutInferRequest):
            raise ValueError(
                f"{where} must return a dict with 'infer_request' (a RolloutInferRequest), got {result!r}"
            )
        _keys(result, STEP_KEYS, where)
        nxt: RolloutInferRequest = result["infer_request"]
        ids, mask, logprobs, given = turn_overrides(
            result, response_choice.token_ids, response_choice.logprobs, where
        )
        try:
            extra = extension(self.chat, st.snapshot, nxt.messages, ids, ids_given=given, where=where)
        except HistoryRewriteError as exc:
            if self.on_sample_error == "raise":
                raise
            return self._fail_request(st, request, response_choice, exc)
        st.request = nxt
        native = dataclasses.replace(
            request,
            prompt_ids=request.prompt_ids + ids + extra,
            messages=native_messages(without_placeholder(nxt.messages), where),
        )
        return {
            "infer_request": native,
            "response_token_ids": ids,
            "response_loss_mask": mask,
            "rollout_logprobs": logprobs,
            "rollout_infos": result.get("rollout_infos"),
        }

    def _fail_request(
        self, st: RequestState, request: MultiTurnRequest, choice: ResponseChoice, exc: HistoryRewriteError
    ) -> dict[str, Any]:
        """Fail this request alone: its sampled ids close the turn untrained, and it finishes at
        the next round (the native driver ends a request only before a step)."""
        st.failed = f"scheduler: {type(exc).__name__}: {exc}"
        ids = list(choice.token_ids)
        return {
            "infer_request": dataclasses.replace(request, prompt_ids=request.prompt_ids + ids),
            "response_token_ids": ids,
            "response_loss_mask": [0] * len(ids),
            "rollout_logprobs": [],
        }
