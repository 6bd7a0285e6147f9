"""The multi-turn driver: `run_multi_turn` steps a rank's requests through a scheduler.

Each round it checks the engine's answers, runs the scheduler's hooks and steps under the
step time limit, records every turn in token space, and votes with the other ranks on whether
another engine call is needed. The scheduler-facing types (`MultiTurnRequest`,
`ResponseChoice`, `RolloutOutput`, `MultiTurnScheduler`, `ToolScheduler`, `EngineRollout`) live
in scheduler.py and are re-exported here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .limits import StepTimeout, await_limited, call_limited, check_time_limit
from .scheduler import (
    EngineRollout,
    MultiTurnRequest,
    MultiTurnScheduler,
    ResponseChoice,
    RolloutFn,
    RolloutOutput,
    ToolScheduler,
)
from .trajectory import Status, validate_tokens
from .vote import GatherFn, RolloutError, RolloutValueError, cast_vote, local_gather

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
    "run_multi_turn",
]


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


STEP_KEYS = ("infer_request", "response_token_ids", "response_loss_mask", "rollout_logprobs", "rollout_infos")
TURN_END_KEYS = ("done", "rollout_infos")


@dataclass
class _Run:
    """What one run_multi_turn call checks every round against."""

    scheduler: MultiTurnScheduler
    max_turns: int | None
    step_timeout_s: float | None  # limit of each on_turn_end and step call
    vocab_size: int | None  # len(tokenizer) of the scheduler's chat; None: no chat, no upper bound
    # ids >= vocab_size the engine sampled: a model's vocabulary may be padded past its tokenizer
    sampled: set[int] = field(default_factory=set)


@dataclass
class _Slot:
    """Driver state of one request."""

    request: MultiTurnRequest
    output: RolloutOutput
    choice: ResponseChoice | None = None
    turn_end: Any = None  # what on_turn_end returned (or raised) this round
    continuing: bool = False  # the next response extends the last turn


def _where(slot: _Slot, turn: int) -> str:
    return f"request {slot.request.index} (turn {turn})"


def _check_ids(ids: Any, where: str, run: _Run, *, bounded: bool = True) -> None:
    """Token ids: a list of Python ints >= 0, inside the vocabulary when `bounded`."""
    if not isinstance(ids, list):
        raise ValueError(f"{where} must be a list of token ids, got {type(ids).__name__}")
    size = run.vocab_size if bounded else None
    for i, t in enumerate(ids):
        # type() and not isinstance(): True is an int, and no tokenizer has a token True
        if type(t) is not int or t < 0 or (size is not None and t >= size and t not in run.sampled):
            below = f" below the vocabulary size {size}" if size is not None else ""
            raise ValueError(f"{where}[{i}] is {t!r}; expected an int >= 0{below} (not a bool)")


def _check_logprobs(logprobs: Any, where: str) -> None:
    """None, or a list of finite numbers; any length (the completeness rule judges the length)."""
    if logprobs is None:
        return
    if not isinstance(logprobs, list):
        raise ValueError(f"{where} must be a list of floats or None, got {type(logprobs).__name__}")
    for i, x in enumerate(logprobs):
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            raise ValueError(f"{where} must be floats, got {x!r} at [{i}]")
        if not math.isfinite(x):
            raise ValueError(f"{where} must be finite, got {x!r} at [{i}]")


def _check_infos(infos: Any, where: str) -> dict[str, Any]:
    if infos is not None and not isinstance(infos, dict):
        raise ValueError(f"{where} rollout_infos must be a dict or None, got {type(infos).__name__}")
    return infos or {}


def _check_keys(result: dict, allowed: tuple[str, ...], where: str) -> None:
    # a misspelt key would otherwise be ignored, and the turn recorded as the engine gave it
    unknown = sorted(str(k) for k in result if k not in allowed)
    if unknown:
        raise ValueError(f"{where} returned unknown key(s) {unknown}; expected some of {list(allowed)}")


def _record(slot: _Slot, ids: list[int], mask: list[int], logprobs: list[float] | None, turn: int) -> None:
    """Append this turn's response after whatever the prompt gained since the last turn."""
    out = slot.output
    covered = len(out.prompt_ids) + sum(len(t) for t in out.response_token_ids)
    context = slot.request.prompt_ids[covered:]  # template/environment ids, never trained
    start, reason = covered + len(context), slot.choice.finish_reason
    if slot.continuing and out.response_token_ids:
        last = out.rollout_logprobs[-1]
        # each piece must match its own mask: a piece one short and the next one long would
        # sum to the right count and shift every logprob of the turn by one token
        fits = last is not None and len(last) == sum(out.response_loss_mask[-1])
        fits = fits and logprobs is not None and len(logprobs) == sum(mask)
        out.response_token_ids[-1] += context + ids
        out.response_loss_mask[-1] += [0] * len(context) + mask
        out.rollout_logprobs[-1] = last + logprobs if fits else None
        out.spans[-1] = (out.spans[-1][0], start + len(ids))
        out.turn_finish_reasons[-1] = reason
    else:
        out.response_token_ids.append(context + ids)
        out.response_loss_mask.append([0] * len(context) + mask)
        out.rollout_logprobs.append(None if logprobs is None else list(logprobs))
        out.spans.append((start, start + len(ids)))
        out.turn_finish_reasons.append(reason)
    out.finish_reason = reason
    out.rollout_infos["num_turns"] = turn


def _accept(slot: _Slot, turn: int, run: _Run) -> bool:
    """Check the engine's answer and add it to the transcript."""
    choice, where = slot.choice, f"{_where(slot, turn)}: rollout_fn"
    if not isinstance(choice, ResponseChoice):
        raise ValueError(f"{where} must return ResponseChoice, got {choice!r}")
    _check_ids(choice.token_ids, f"{where} token_ids", run, bounded=False)
    _check_logprobs(choice.logprobs, f"{where} logprobs")
    if not isinstance(choice.text, str):
        raise ValueError(f"{where} text must be a str, got {type(choice.text).__name__}")
    if run.vocab_size is not None:
        run.sampled.update(t for t in choice.token_ids if t >= run.vocab_size)
    messages = slot.request.messages
    if messages and messages[-1].get("role") == "assistant":
        messages[-1]["content"] += choice.text
    else:
        messages.append({"role": "assistant", "content": choice.text})
    return True


def _hook_result(slot: _Slot, turn: int) -> bool | None:
    """The hook's `done` (None: let check_finished decide); its infos go to the output."""
    result, where = slot.turn_end, f"{_where(slot, turn)}: on_turn_end"
    if isinstance(result, BaseException):
        raise result
    if result is None:
        return None
    if not isinstance(result, dict):
        raise ValueError(f"{where} must return a dict or None, got {result!r}")
    _check_keys(result, TURN_END_KEYS, where)
    done = result.get("done")
    if done is not None and not isinstance(done, bool):
        raise ValueError(f"{where} 'done' must be a bool or None, got {done!r}")
    slot.output.rollout_infos.update(_check_infos(result.get("rollout_infos"), where))
    return done


def _apply_step(slot: _Slot, result: Any, run: _Run, turn: int) -> None:
    """Record the turn as the scheduler's step shaped it and move to its next request."""
    req, choice, where = slot.request, slot.choice, f"{_where(slot, turn)}: scheduler.step()"
    nxt = result.get("infer_request") if isinstance(result, dict) else None
    if not isinstance(nxt, MultiTurnRequest):
        raise ValueError(
            f"{where} must return a dict with 'infer_request' (a MultiTurnRequest), got {result!r}"
        )
    _check_keys(result, STEP_KEYS, where)
    ids = result.get("response_token_ids", choice.token_ids)
    _check_ids(ids, f"{where} response_token_ids", run)
    mask = result.get("response_loss_mask", [1] * len(ids))
    if not isinstance(mask, list) or not all(isinstance(m, int) for m in mask):
        raise ValueError(f"{where} response_loss_mask must be a list of 0/1 ints, got {mask!r}")
    # the scheduler's logprobs are preferred: it knows which tokens it kept
    logprobs = result.get("rollout_logprobs", choice.logprobs)
    _check_logprobs(logprobs, f"{where} rollout_logprobs")
    validate_tokens(ids, mask, logprobs, where=f"{where} response")
    infos = _check_infos(result.get("rollout_infos"), where)
    if nxt.index != req.index:
        raise ValueError(
            f"{where}: infer_request.index is {nxt.index}; expected {req.index} (the same request)"
        )
    _check_ids(nxt.prompt_ids, f"{where} infer_request.prompt_ids", run)
    if not isinstance(nxt.messages, list) or not all(isinstance(m, dict) for m in nxt.messages):
        raise ValueError(f"{where} infer_request.messages must be a list of dicts")
    expected = req.prompt_ids + ids
    if nxt.prompt_ids[: len(expected)] != expected:
        raise ValueError(
            f"{where}: infer_request.prompt_ids must extend the previous prompt_ids + "
            f"response_token_ids ({len(expected)} tokens); rebuild it with reply()/continue_turn()"
        )
    _record(slot, list(ids), [int(m) for m in mask], logprobs, turn)
    slot.output.rollout_infos.update(infos)
    slot.continuing = bool(nxt.messages) and nxt.messages[-1].get("role") == "assistant"
    slot.request = slot.output.request = dataclasses.replace(nxt, turn=turn + 1)


def _freeze(slot: _Slot, turn: int, status: Status) -> None:
    """End the request: its last response is its final turn, every sampled token trained."""
    ids = slot.choice.token_ids
    _record(slot, list(ids), [1] * len(ids), slot.choice.logprobs, turn)
    slot.output.status = status


def _time_out(slot: _Slot, turn: int, call: str, limit: float) -> bool:
    """A hook or step ran past its limit: the request ends as if finished, status TIMEOUT."""
    _freeze(slot, turn, Status.TIMEOUT)
    slot.output.rollout_infos["timeout"] = f"{call} exceeded {limit:g} s at turn {turn}"
    return False


def _finish_or_step(slot: _Slot, run: _Run, turn: int) -> bool:
    """Freeze a finished request into its output, or step it; True while it still runs."""
    if isinstance(slot.turn_end, StepTimeout):
        return _time_out(slot, turn, "on_turn_end", run.step_timeout_s)
    scheduler, max_turns = run.scheduler, run.max_turns
    done = _hook_result(slot, turn)
    finished = done if done is not None else scheduler.check_finished(slot.request, slot.choice, turn)
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


def _guarded(slots: list[_Slot], errors: list[Exception], fn: Callable[[_Slot], bool]) -> list[_Slot]:
    """Apply fn per slot; a failure marks only that request FAILED, the others carry on."""
    kept = []
    for slot in slots:
        try:
            if fn(slot):
                kept.append(slot)
        except Exception as exc:
            slot.output.status, slot.output.error = Status.FAILED, f"{type(exc).__name__}: {exc}"
            errors.append(exc)
    return kept


async def _turn_ends(run: _Run, slots: list[_Slot], turn: int) -> list[Any]:
    # concurrent: environments and tools may await I/O; one hook's exception (or StepTimeout)
    # is kept for its request
    serial = asyncio.Lock()
    calls = (
        await_limited(
            run.scheduler.on_turn_end, s.request, s.choice, turn, limit=run.step_timeout_s, serial=serial
        )
        for s in slots
    )
    return await asyncio.gather(*calls, return_exceptions=True)


def _round(slots: list[_Slot], choices: Sequence[ResponseChoice], run: _Run, turn: int) -> list[_Slot]:
    """Everything between two engine calls; returns the slots that need another turn."""
    if len(choices) != len(slots):
        raise ValueError(f"turn {turn}: got {len(choices)} responses for {len(slots)} requests")
    for slot, choice in zip(slots, choices, strict=True):
        slot.choice = choice
    errors: list[Exception] = []
    ok = _guarded(slots, errors, lambda s: _accept(s, turn, run))
    if ok:
        for slot, result in zip(ok, asyncio.run(_turn_ends(run, ok, turn)), strict=True):
            slot.turn_end = result
    running = _guarded(ok, errors, lambda s: _finish_or_step(s, run, turn))
    if errors:  # the first names its request; every failed request is FAILED in the outputs
        raise errors[0]
    return running


def _start(requests: Sequence[MultiTurnRequest], run: _Run) -> list[_Slot]:
    for r in requests:
        if not isinstance(r, MultiTurnRequest):
            raise ValueError(f"run_multi_turn: requests must be MultiTurnRequest, got {r!r}")
        _check_ids(r.prompt_ids, f"request {r.index}: prompt_ids", run)
    # private copies of the transcripts: the driver appends the replies to them
    own = [dataclasses.replace(r, messages=[dict(m) for m in r.messages]) for r in requests]
    run.scheduler.on_trajectory_start(own)
    return [_Slot(request=r, output=RolloutOutput(request=r, prompt_ids=list(r.prompt_ids))) for r in own]


def run_multi_turn(
    requests: Sequence[MultiTurnRequest],
    first_turn_outputs: Sequence[ResponseChoice],
    scheduler: MultiTurnScheduler,
    rollout_fn: RolloutFn,
    request_config: Any,
    max_turns: int | None = None,
    gather_fn: GatherFn = local_gather,
    *,
    rank: int = 0,
    step_timeout_s: float | None = None,
) -> list[RolloutOutput]:
    """Drive this rank's requests to the end; one output per request, in request order.

    Each round: hooks run concurrently; a request is finished by the hook's `done`, else by
    `check_finished`, else by `max_turns`; the others go through `scheduler.step`. Then all
    ranks vote through `gather_fn`, and while any rank has work every rank calls
    `rollout_fn(requests, request_config)`, an idle one with `[]`. A failure on any rank
    (bad input, a hook or step raising, rollout_fn raising) is raised on every rank as a
    `MultiTurnError` (`MultiTurnValueError` for bad input) whose `outputs` keep this rank's
    work; the local exception is its `__cause__`. Hooks run under `asyncio.run`, so call
    this from synchronous code (not from inside a running event loop).

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
    """
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"run_multi_turn: max_turns must be >= 1 or None, got {max_turns}")
    check_time_limit(step_timeout_s, "run_multi_turn: step_timeout_s")
    chat = scheduler.chat
    run = _Run(scheduler, max_turns, step_timeout_s, len(chat.tokenizer) if chat is not None else None)
    slots: list[_Slot] = []
    running: list[_Slot] = []
    choices: Sequence[ResponseChoice] = first_turn_outputs
    pending: Exception | None = None  # rollout_fn's failure, voted on before anything else
    turn = 1
    while True:
        error = pending
        try:
            if pending is None:
                if turn == 1:
                    slots = running = _start(requests, run)
                running = _round(running, choices, run, turn)
        except Exception as exc:
            error = exc
        try:
            ballots = cast_vote(gather_fn, rank=rank, active=bool(running) and error is None, error=error)
        except RolloutError as err:
            cls = MultiTurnValueError if isinstance(err, ValueError) else MultiTurnError
            raise cls(err.failures, [s.output for s in slots]) from error
        if not any(b.active for b in ballots):
            return [s.output for s in slots]
        try:  # a collective: every rank of the group calls it in the same round
            choices = rollout_fn([s.request for s in running], request_config)
        except Exception as exc:
            pending = exc
        turn += 1
