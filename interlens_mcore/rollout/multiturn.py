"""The multi-turn driver: `run_multi_turn` steps a rank's requests through a scheduler.

Each round (the lockstep round of round.py, shared with `co_step`) it checks the engine's
answers, runs the scheduler's hooks and steps under the step time limit, records every turn in
token space, and votes with the other ranks on whether another engine call is needed. The
scheduler-facing types (`MultiTurnRequest`, `ResponseChoice`, `RolloutOutput`,
`MultiTurnScheduler`, `ToolScheduler`, `EngineRollout`) live in scheduler.py and are
re-exported here.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field

from ..engines.base import SamplingParams
from ..types import Status, TrainTurns, check_train_turns
from .limits import StepTimeout, await_limited, call_limited, check_time_limit
from .outcome import OnSampleError, SampleErrors, check_on_sample_error, fail, time_out, truncate
from .results import (
    STEP_KEYS,
    TURN_END_KEYS,
    check_choice,
    check_ids,
    prepare_requests,
    prepare_requests_async,
    step_result,
    turn_end_result,
)
from .round import Call, Driver, Need, Slices, each, no_running_loop, raise_first, run_rounds, settle
from .scheduler import (
    EngineRollout,
    MultiTurnError,
    MultiTurnRequest,
    MultiTurnScheduler,
    MultiTurnValueError,
    ResponseChoice,
    RolloutFn,
    RolloutOutput,
    ToolScheduler,
)
from .vote import GatherFn, RolloutError, local_gather

__all__ = [
    "STEP_KEYS",
    "TURN_END_KEYS",
    "EngineRollout",
    "MultiTurnError",
    "MultiTurnRequest",
    "MultiTurnScheduler",
    "MultiTurnValueError",
    "ResponseChoice",
    "RolloutFn",
    "RolloutOutput",
    "ToolScheduler",
    "prepare_requests",
    "prepare_requests_async",
    "run_multi_turn",
    "run_multi_turn_async",
]


@dataclass
class _Run:
    """What one run_multi_turn call checks every round against."""

    scheduler: MultiTurnScheduler
    max_turns: int | None
    step_timeout_s: float | None  # limit of each on_turn_end and step call
    vocab_size: int | None  # len(tokenizer) of the scheduler's chat; None: no chat, no upper bound
    train_turns: TrainTurns = "all"
    errors: SampleErrors = field(default_factory=SampleErrors)  # one request's failure: raised or kept
    # ids >= vocab_size the engine sampled: a model's vocabulary may be padded past its tokenizer
    sampled: set[int] = field(default_factory=set)

    def check_ids(self, ids: object, where: str) -> None:
        check_ids(ids, where, self.vocab_size, self.sampled)


@dataclass
class _Slot:
    """Driver state of one request."""

    request: MultiTurnRequest
    output: RolloutOutput
    choice: ResponseChoice | None = None
    turn_end: object = None  # what on_turn_end returned (or raised) this round
    continuing: bool = False  # the next response extends the last turn

    @property
    def answer(self) -> ResponseChoice:
        """This round's response: `_Turns._round` sets it before anything reads it."""
        assert self.choice is not None, "a slot is read only after its round's response arrived"
        return self.choice


def _where(slot: _Slot, turn: int) -> str:
    return f"request {slot.request.index} (turn {turn})"


def _accept(slot: _Slot, turn: int, run: _Run) -> None:
    """Check the engine's answer and add it to the transcript."""
    choice = check_choice(slot.choice, f"{_where(slot, turn)}: rollout_fn")
    if run.vocab_size is not None:
        run.sampled.update(t for t in choice.token_ids if t >= run.vocab_size)
    messages = slot.request.messages
    if messages and messages[-1].get("role") == "assistant":
        messages[-1]["content"] += choice.text
    else:
        messages.append({"role": "assistant", "content": choice.text})


def _apply_step(slot: _Slot, result: object, run: _Run, turn: int) -> None:
    """Record the turn as the scheduler's step shaped it and move to its next request."""
    where = f"{_where(slot, turn)}: scheduler.step()"
    step = step_result(result, slot.request, slot.answer, where, run.check_ids)
    slot.output.add_turn(slot.request, step.ids, step.mask, step.logprobs, slot.answer, slot.continuing)
    slot.output.rollout_infos.update(step.infos)
    nxt = step.request
    slot.continuing = bool(nxt.messages) and nxt.messages[-1].get("role") == "assistant"
    slot.request = slot.output.request = dataclasses.replace(nxt, turn=turn + 1, response=None)


def _freeze(slot: _Slot, turn: int, status: Status) -> None:
    """End the request: its last response is its final turn, every sampled token trained."""
    choice = slot.answer
    ids = choice.token_ids
    if choice.truncated and not ids:  # its prompt did not fit: the engine saw none of it
        spans = slot.output.spans
        slot.output.seen = spans[-1][1] if spans else 0
    slot.output.add_turn(slot.request, list(ids), [1] * len(ids), choice.logprobs, choice, slot.continuing)
    slot.output.status = status


def _time_out(slot: _Slot, turn: int, call: str, limit: float | None) -> bool:
    """A hook or step ran past its limit: the request ends as if finished, status TIMEOUT."""
    time_out(_Ending(slot, turn), call, limit, turn)
    return False


@dataclass
class _Ending:
    """A request as `outcome` ends it: a timeout or a full context freezes its last response (a
    timeout says which call ran late in `rollout_infos["timeout"]`); a failure keeps its reason
    as the output's error."""

    slot: _Slot
    turn: int = 0

    def end(self, status: Status, reason: str) -> None:
        output = self.slot.output
        if status in (Status.TIMEOUT, Status.TRUNCATED):
            _freeze(self.slot, self.turn, status)
            if status is Status.TIMEOUT:
                output.rollout_infos["timeout"] = reason
        else:
            output.status, output.error = status, reason


def _finish_or_step(slot: _Slot, run: _Run, turn: int) -> bool:
    """Freeze a finished request into its output, or step it; True while it still runs."""
    if isinstance(slot.turn_end, StepTimeout):
        return _time_out(slot, turn, "on_turn_end", run.step_timeout_s)
    scheduler, max_turns = run.scheduler, run.max_turns
    # the hook's `done` decides; None lets check_finished decide
    done, infos = turn_end_result(slot.turn_end, f"{_where(slot, turn)}: on_turn_end")
    slot.output.rollout_infos.update(infos)
    if slot.answer.truncated:  # no room for another turn: this request alone ends, its turns kept
        truncate(_Ending(slot, turn), "the engine's context is full")
        return False
    finished = done if done is not None else scheduler.check_finished(slot.request, slot.answer, turn)
    capped = any(m is not None and turn >= m for m in (max_turns, scheduler.max_turns))
    if finished or (max_turns is not None and turn >= max_turns):
        _freeze(slot, turn, Status.MAX_TURNS if capped and done is not True else Status.STOPPED)
        return False
    try:
        result = call_limited(scheduler.step, slot.request, slot.choice, turn, limit=run.step_timeout_s)
    except StepTimeout:
        return _time_out(slot, turn, "step", run.step_timeout_s)
    _apply_step(slot, result, run, turn)
    return True


def _fail(slot: _Slot, exc: Exception) -> None:
    """The scheduler's code for this request raised, or returned what the driver refuses."""
    fail(_Ending(slot), exc, what="scheduler")


def _engine_failed(slot: _Slot, exc: Exception) -> None:
    fail(_Ending(slot), exc, what="rollout_fn")


class _Turns(Driver):
    """run_multi_turn's half of the lockstep round: the scheduler's work, then one rollout_fn call."""

    def __init__(
        self,
        run: _Run,
        requests: Sequence[MultiTurnRequest],
        first: Sequence[ResponseChoice],
        rollout_fn: RolloutFn,
        request_config: SamplingParams,
        overlap: int = 1,
    ):
        self.run, self.requests, self.first = run, requests, first
        self.rollout_fn, self.request_config = rollout_fn, request_config
        self.slots: list[_Slot] | None = None  # None until started (in the first local phase)
        # overlap: the requests in `overlap` slices taking rounds in turn, as in co_step; per
        # slice its running slots, the engine's last answers to them and their turn
        self.overlap, self.slicing = overlap, Slices(overlap)
        self.running: list[list[_Slot]] = []
        self.choices: list[Sequence[ResponseChoice]] = []
        self.turns: list[int] = [1] * overlap

    def busy(self) -> bool:
        return self.slicing.on and self.slots is not None and any(self.running)

    async def local(self) -> dict[str, Need]:
        if self.slots is None:
            self.slots = _start(self.requests, self.run)
            if len(self.first) != len(self.slots):  # before slicing hides it
                raise ValueError(f"turn 1: got {len(self.first)} responses for {len(self.slots)} requests")
            k = self.overlap
            self.running = [self.slots[s::k] for s in range(k)]
            self.choices = [list(self.first[s::k]) for s in range(k)]
        s = self.slicing.next()
        # with overlap most started while rollout_fn answered another slice
        self.running[s] = await self.slicing.run(s, lambda: self._slice_round(s))
        self.choices[s] = []
        running = self.running[s]
        return {"rollout_fn": Need(engine="rollout_fn", rows=len(running))} if running else {}

    def call(self, calls: list[Call]) -> None:
        # one collective per round while any rank works, whatever this rank asked: an idle rank
        # calls rollout_fn with no requests
        s = self.slicing.current
        self.turns[s] += 1
        self.choices[s] = self.rollout_fn([slot.request for slot in self.running[s]], self.request_config)

    async def call_async(self, calls: list[Call]) -> None:
        if not self.slicing.on:
            return self.call(calls)
        if not calls:  # no rank has this slice's requests left (the same on every rank): no call
            return
        # the other slices' hooks and steps run while rollout_fn answers this one
        self.slicing.start_others(lambda t: bool(self.running[t]), self._slice_round)
        self.call(calls)

    def _slice_round(self, s: int) -> Coroutine[object, object, list[_Slot]]:
        return self._round(self.running[s], self.choices[s], self.turns[s])

    async def _round(self, slots: list[_Slot], choices: Sequence[ResponseChoice], turn: int) -> list[_Slot]:
        """Everything between two engine calls; returns the slots that need another turn."""
        run = self.run
        if len(choices) != len(slots):
            raise ValueError(f"turn {turn}: got {len(choices)} responses for {len(slots)} requests")
        for slot, choice in zip(slots, choices, strict=True):
            slot.choice = choice
        # the engine's answers: rollout_fn's output is no request's fault, it fails the rollout
        engine_errors: list[Exception] = []
        ok = each(slots, lambda s: _accept(s, turn, run), _engine_failed, engine_errors)
        errors: list[Exception] = []
        serial, hook, limit = asyncio.Lock(), run.scheduler.on_turn_end, run.step_timeout_s

        async def turn_end(s: _Slot) -> None:  # concurrent: environments and tools may await I/O
            try:
                s.turn_end = await await_limited(hook, s.request, s.choice, turn, limit=limit, serial=serial)
            except StepTimeout as exc:
                s.turn_end = exc
            except Exception as exc:
                exc.add_note(f"{_where(s, turn)}: on_turn_end raised")
                raise

        ok = await settle(ok, turn_end, _fail, errors)
        running: list[_Slot] = []

        def finish_or_step(s: _Slot) -> None:
            if _finish_or_step(s, run, turn):
                running.append(s)

        each(ok, finish_or_step, _fail, errors)
        raise_first(engine_errors)  # first: they came first
        run.errors.settle(errors)  # "raise": the first names its request; every failed one is FAILED
        return running


def _start(requests: Sequence[MultiTurnRequest], run: _Run) -> list[_Slot]:
    for r in requests:
        if not isinstance(r, MultiTurnRequest):
            raise ValueError(f"run_multi_turn: requests must be MultiTurnRequest, got {r!r}")
        run.check_ids(r.prompt_ids, f"request {r.index}: prompt_ids")
    # private copies of the transcripts: the driver appends the replies to them
    own = [dataclasses.replace(r, messages=[dict(m) for m in r.messages], turn=1) for r in requests]
    run.scheduler.on_trajectory_start(own)
    outputs = [
        RolloutOutput(request=r, prompt_ids=list(r.prompt_ids), train_turns=run.train_turns) for r in own
    ]
    return [_Slot(request=r, output=o) for r, o in zip(own, outputs, strict=True)]


async def run_multi_turn_async(
    requests: Sequence[MultiTurnRequest],
    first_turn_outputs: Sequence[ResponseChoice],
    scheduler: MultiTurnScheduler,
    rollout_fn: RolloutFn,
    request_config: SamplingParams,
    max_turns: int | None = None,
    gather_fn: GatherFn = local_gather,
    *,
    rank: int = 0,
    step_timeout_s: float | None = None,
    train_turns: TrainTurns = "all",
    on_sample_error: OnSampleError = "raise",
    overlap: int = 1,
) -> list[RolloutOutput]:
    """`run_multi_turn` for callers inside a running event loop."""
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"run_multi_turn: max_turns must be >= 1 or None, got {max_turns}")
    check_time_limit(step_timeout_s, "run_multi_turn: step_timeout_s")
    check_train_turns(train_turns, "run_multi_turn")
    check_on_sample_error(on_sample_error, "run_multi_turn: on_sample_error")
    if not isinstance(overlap, int) or isinstance(overlap, bool) or overlap < 1:
        raise ValueError(f"run_multi_turn: overlap must be an int >= 1 (1: no overlap), got {overlap!r}")
    chat = scheduler.chat
    vocab = len(chat.tokenizer) if chat is not None else None
    run = _Run(scheduler, max_turns, step_timeout_s, vocab, train_turns, SampleErrors(on_sample_error))
    driver = _Turns(run, requests, first_turn_outputs, rollout_fn, request_config, overlap)
    try:
        await run_rounds(driver, gather_fn=gather_fn, rank=rank)
    except RolloutError as err:
        cls = MultiTurnValueError if isinstance(err, ValueError) else MultiTurnError
        raise cls(err.failures, [s.output for s in driver.slots or []]) from err.__cause__
    finally:
        driver.slicing.close()
    return [s.output for s in driver.slots or []]


def run_multi_turn(
    requests: Sequence[MultiTurnRequest],
    first_turn_outputs: Sequence[ResponseChoice],
    scheduler: MultiTurnScheduler,
    rollout_fn: RolloutFn,
    request_config: SamplingParams,
    max_turns: int | None = None,
    gather_fn: GatherFn = local_gather,
    *,
    rank: int = 0,
    step_timeout_s: float | None = None,
    train_turns: TrainTurns = "all",
    on_sample_error: OnSampleError = "raise",
    overlap: int = 1,
) -> list[RolloutOutput]:
    """Drive this rank's requests to the end; one output per request, in request order.

    The caller generates the first turn (`first_turn_outputs`), after running the scheduler's
    `before_first_turn` through `prepare_requests(scheduler, requests)`. Each round: hooks run
    concurrently; a request is finished by the hook's `done`, else by `check_finished`, else
    by `max_turns`; the others go through `scheduler.step`. Then all ranks vote through
    `gather_fn`, and while any rank has work every rank calls
    `rollout_fn(requests, request_config)`, an idle one with `[]`. A failure on any rank
    (bad input, a hook or step raising, rollout_fn raising) is raised on every rank as a
    `MultiTurnError` (`MultiTurnValueError` for bad input) whose `outputs` keep this rank's
    work; the local exception is its `__cause__`. Inside a running event loop,
    `await run_multi_turn_async(...)` instead.

    `train_turns` chooses the trained turns of every output's trajectory, like ms-swift's
    `loss_scale`: "all" (default), the "last", or one bool per turn.

    `step_timeout_s` limits each `on_turn_end` and each `step` call. A request whose call
    runs past it ends there, not as a failure: its last response is recorded as for a
    finished request, its status is TIMEOUT and `rollout_infos["timeout"]` says which call.
    A hook is cancelled at the limit; a step runs in a daemon thread that cannot be killed,
    so it may finish later, and what it returns is discarded.

    Bad scheduler output is a ValueError naming the request and the field: token ids that
    are not ints >= 0 below `len(chat.tokenizer)` (ids the engine sampled are always
    allowed), masks that are not 0/1 or not as long as the ids, non-finite logprobs,
    infos that are not dicts, a `done` that is not a bool, unknown keys. Logprobs of another
    length than the trained tokens are not an error: they are dropped for that sample.

    `on_sample_error` "skip" keeps one request's failure (a hook or step raising, its bad
    output) on that request: it ends FAILED, its `error` "scheduler: <ExcType>: <text>", and
    the others carry on; nothing is raised for it. Failures that are not one request's
    (rollout_fn and its answers, the vote, bad arguments) fail the rollout whatever it says.

    `overlap` > 1 runs the requests in that many slices taking rounds in turn, as
    `co_step(overlap=...)` does: while `rollout_fn` answers one slice on the calling thread,
    the other slices' `on_turn_end` hooks and steps run on an event loop in a helper thread. A
    request's turns are the same as without it when `rollout_fn`'s answer to a request does not
    depend on the others in its call (`EngineRollout`'s do not: it seeds each request alone).
    """
    no_running_loop("run_multi_turn")
    return asyncio.run(run_multi_turn_async(**locals()))  # every argument, by name
