"""`run`: ms-swift schedulers driven by the native `run_multi_turn`, with ms-swift's meaning.

Before the native driver starts, `run` awaits the scheduler's `on_trajectory_start` (it may
rewrite the requests: a gym scheduler puts each environment's first observation there),
renders each request's messages once into its first prompt (a last assistant message is a
prefill the engine continues) and generates the first turn; the ranks vote after each of
those, so a failure on one rank fails all of them before the next collective. The native
driver then runs the turns through `SwiftBridge`; `on_trajectory_end` runs at the end, also
after a failure.

An exception the scheduler's own code raised is raised again, unchanged, on the rank where
it happened (`except TimeoutError:` still matches), with a note naming the request, the
hook and the turn; every other rank of the group raises `MultiTurnError` naming it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Sequence
from typing import get_args

from ... import (
    ChatFormat,
    EngineRollout,
    MultiTurnError,
    MultiTurnRequest,
    MultiTurnValueError,
    RolloutError,
    RolloutOutput,
    SamplingParams,
    Status,
    Trajectory,
    run_multi_turn,
)
from ...chat import Tokenizer
from ...engines.base import Engine
from ...rollout.limits import StepTimeout, await_limited, check_time_limit, maybe_await
from ...rollout.outcome import OnSampleError
from ...rollout.rollouter import Sample, expand_rows
from ...rollout.vote import GatherFn, cast_vote, local_gather
from .bridge import RequestState, SwiftBridge, add_note
from .foreign import as_ours
from .scheduler import MultiTurnScheduler
from .transcript import native_messages, prompt_ids, without_placeholder
from .types import Message, RolloutInferRequest, SwiftOutput, TrainTurns

Row = RolloutInferRequest | dict[str, object] | list[Message]


def build_requests(
    rows: Sequence[Row], *, num_generations: int = 1, rank: int = 0, seed: int = 0
) -> list[RequestState]:
    """`num_generations` requests per row, each with its own copy of the row's messages and data.

    A dict row's `messages` become the request's messages and its other fields its
    `data_dict` (a row without messages needs an `on_trajectory_start` that sets them); a list
    row is the messages. Rows expand as on every rollout path (`expand_rows`): indices name the
    rank, row and sample; a request's uuid is `<seed in hex>-<index>`. Turns are seeded by
    `seed` and the index, as `EngineRollout` seeds requests without a seed of their own.
    """
    samples = expand_rows(rows, num_generations=num_generations, rank=rank, stream=(seed,), tag=f"{seed:x}")
    # ms-swift's short uuids here; a trainer's plan names requests as its conversations
    return sample_requests([dataclasses.replace(s, id=f"{seed:x}-{s.index}") for s in samples], seeded=False)


def sample_requests(samples: Sequence[Sample[object]], *, seeded: bool = True) -> list[RequestState]:
    """One request per sample (a `Rollouter.plan`'s): its uuid the sample's id, its turns seeded
    by the sample's seed (`seeded`) or by its index."""
    states: list[RequestState] = []
    for sample in samples:
        messages, data = _split(sample.row, sample.group)
        request = RolloutInferRequest(
            messages=copy.deepcopy(messages), data_dict=copy.deepcopy(data), uuid=sample.id
        )
        states.append(
            RequestState(
                request=request,
                index=sample.index,
                position=len(states),
                group=sample.group,
                seed=sample.seed if seeded else None,
            )
        )
    return states


def _split(row: object, i: int) -> tuple[list[Message], dict[str, object]]:
    """(messages, data_dict) of row `i`."""
    if isinstance(row, RolloutInferRequest):
        messages, data = row.messages, dict(row.data_dict)
    elif isinstance(row, dict):
        messages, data = row.get("messages", []), {k: v for k, v in row.items() if k != "messages"}
    elif isinstance(row, list):
        messages, data = row, {}
    else:
        raise ValueError(f"row {i}: expected a dict, a message list or a RolloutInferRequest, got {row!r}")
    if not isinstance(messages, list):
        raise ValueError(f"row {i}: messages must be a list of dicts, got {type(messages).__name__}")
    return messages, data


def _cap(max_turns: object) -> int | None:
    if max_turns is None or max_turns == 0:  # ms-swift: 0 and None both mean no cap
        return None
    if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 0:
        raise ValueError(f"max_turns must be an int >= 0 or None (0: no cap), got {max_turns!r}")
    return max_turns


def _agreed(gather_fn: GatherFn, rank: int, error: BaseException | None) -> MultiTurnError | None:
    """One round of the group's vote outside the native driver: the group's failure, or None.

    The failure is a `MultiTurnError` (`MultiTurnValueError` for bad input), as the native
    driver's are, with no outputs: no turn has been recorded yet.
    """
    try:
        cast_vote(gather_fn, rank=rank, active=True, error=error)
    except RolloutError as failure:
        cls = MultiTurnValueError if isinstance(failure, ValueError) else MultiTurnError
        failure = cls(failure.failures, [])
        failure.__cause__ = error
        return failure
    return None


def _raise(failure: MultiTurnError, error: BaseException | None, bridge: SwiftBridge):
    """The scheduler's own exception on the rank that raised it, the group's failure elsewhere."""
    own = bridge.own(error)
    if own is None:
        raise failure
    add_note(own, f"the rollout failed on every rank of its group: {failure}")
    raise own


async def _start(scheduler: MultiTurnScheduler, requests: list[RolloutInferRequest], limit: float | None):
    try:
        await await_limited(scheduler.on_trajectory_start, requests, limit=limit, serial=asyncio.Lock())
    except StepTimeout:
        raise TimeoutError(f"{type(scheduler).__name__}.on_trajectory_start exceeded {limit:g} s") from None


def _first_requests(chat: ChatFormat, states: list[RequestState]) -> list[MultiTurnRequest]:
    out = []
    for st in states:
        where = f"request {st.request.uuid} (index {st.index})"
        messages = without_placeholder(st.request.messages)
        out.append(
            MultiTurnRequest(
                index=st.index,
                prompt_ids=prompt_ids(chat, messages, where),
                messages=native_messages(messages, where),
                data={"group": st.group},
                seed=st.seed,
            )
        )
    return out


def _override_final(out: RolloutOutput, st: RequestState) -> None:
    """Put the final turn as on_turn_end shaped it (checked in its round) in place of the sampled ids."""
    if st.final is None:
        return
    ids, mask, logprobs = st.final
    choice = st.reply
    turn, turn_mask = out.response_token_ids[-1], out.response_loss_mask[-1]
    k = len(turn) - len(choice.token_ids)  # the sampled ids are the turn's tail
    before = sum(turn_mask[:k])
    turn[k:], turn_mask[k:] = ids, mask
    old = out.rollout_logprobs[-1]
    out.rollout_logprobs[-1] = None if old is None or logprobs is None else old[:before] + logprobs
    start, end = out.spans[-1]
    out.spans[-1] = (start, end - len(choice.token_ids) + len(ids))


def _finish(out: RolloutOutput, st: RequestState, train_turns: TrainTurns) -> SwiftOutput:
    if st.failed is not None:  # the bridge failed this request alone (a rewritten history)
        out.status, out.error = Status.FAILED, st.failed
    elif out.status in (Status.STOPPED, Status.MAX_TURNS):
        _override_final(out, st)
        out.status = Status.MAX_TURNS if st.by_cap else Status.STOPPED
    last = len(out.response_loss_mask) - 1
    for t, mask in enumerate(out.response_loss_mask):
        if (train_turns == "last_round" and t != last) or st.failed is not None:  # a failure trains nothing
            mask[:] = [0] * len(mask)
        if sum(mask) == 0:  # a turn that trains nothing needs no logprobs: it must not turn IS off
            out.rollout_logprobs[t] = []
    return SwiftOutput(
        request=st.request,
        prompt_ids=out.prompt_ids,
        response_token_ids=out.response_token_ids,
        response_loss_mask=out.response_loss_mask,
        rollout_logprobs=out.rollout_logprobs,
        rollout_infos=out.rollout_infos,
        status=out.status,
        native=out,
    )


def run(
    rows: Sequence[Row],
    scheduler: MultiTurnScheduler | object,
    engine: Engine,
    tokenizer: Tokenizer,
    sampling: SamplingParams,
    *,
    num_generations: int = 1,
    max_turns: int | None = None,
    seed: int = 0,
    gather_fn: GatherFn = local_gather,
    rank: int = 0,
    step_timeout_s: float | None = None,
    train_turns: TrainTurns = "all",
    on_sample_error: OnSampleError = "raise",
) -> list[SwiftOutput]:
    """Roll out this rank's rows with an ms-swift scheduler; one output per request, in order.

    `scheduler` is a `compat.swift.MultiTurnScheduler`, or one built on ms-swift's own base
    classes (its release `multi_turn.py` with the import lines changed), run by its hooks.

    Collective over the group `gather_fn` votes in: every rank calls it, with its own rows.
    `max_turns` (default: the scheduler's) of 0 or None means no cap. `train_turns`
    "last_round" trains only each request's last turn (ms-swift's `--loss_scale last_round`).
    `step_timeout_s` limits `on_trajectory_start` and each hook and step call, as in
    `run_multi_turn`. Hooks run under `asyncio.run`: call this from synchronous code.
    `on_sample_error` "skip": a hook or step that raises for one request ends that request
    FAILED (`status`, and its trajectory's `infos.stop_reason` "scheduler: <ExcType>: <text>")
    and the others carry on; "raise" (default) fails the rollout as described above.
    `on_trajectory_start` and `on_trajectory_end` see every request: their failures always do.
    """
    states = build_requests(rows, num_generations=num_generations, rank=rank, seed=seed)
    return run_requests(
        states, scheduler, engine, tokenizer, sampling,
        max_turns=max_turns, seed=seed, gather_fn=gather_fn, rank=rank,
        step_timeout_s=step_timeout_s, train_turns=train_turns, on_sample_error=on_sample_error,
    )  # fmt: skip


def _check(scheduler: object, train_turns: str, step_timeout_s: float | None) -> MultiTurnScheduler:
    """`scheduler` as ours (one on ms-swift's own base classes wrapped), once the options are checked."""
    ours = as_ours(scheduler, "compat.swift.run")
    if train_turns not in get_args(TrainTurns):
        raise ValueError(f"train_turns must be one of {get_args(TrainTurns)}, got {train_turns!r}")
    check_time_limit(step_timeout_s, "compat.swift.run: step_timeout_s")
    return ours


def run_requests(
    states: list[RequestState],
    scheduler: MultiTurnScheduler | object,
    engine: Engine,
    tokenizer: Tokenizer,
    sampling: SamplingParams,
    *,
    max_turns: int | None = None,
    seed: int = 0,
    gather_fn: GatherFn = local_gather,
    rank: int = 0,
    step_timeout_s: float | None = None,
    train_turns: TrainTurns = "all",
    on_sample_error: OnSampleError = "raise",
) -> list[SwiftOutput]:
    """`run` over requests already built (`build_requests`, `sample_requests`)."""
    scheduler = _check(scheduler, train_turns, step_timeout_s)
    cap = _cap(scheduler.max_turns if max_turns is None else max_turns)
    chat = ChatFormat(tokenizer)
    scheduler.bind(engine, tokenizer)
    bridge = SwiftBridge(scheduler, chat, states, cap, on_sample_error=on_sample_error)
    error: BaseException | None  # the first failure on this rank, kept for the notes
    first_requests, error = _open(scheduler, states, chat, bridge, step_timeout_s)
    failure = _agreed(gather_fn, rank, error)
    if failure is None:
        rollout_fn = EngineRollout(engine, chat, seed=seed)
        try:  # a collective: every rank calls it, one with no requests too
            first = rollout_fn(first_requests, sampling)
        except Exception as exc:
            error = exc
        failure = _agreed(gather_fn, rank, error)
    if failure is None:
        try:
            outputs = run_multi_turn(
                first_requests, first, bridge, rollout_fn, sampling, None, gather_fn,
                rank=rank, step_timeout_s=step_timeout_s, on_sample_error=on_sample_error,
            )  # fmt: skip
        except MultiTurnError as exc:
            failure, error = exc, exc.__cause__
    # every rank's on_trajectory_end learns of a failure, also where it did not happen
    end_error = _end(scheduler, [st.request for st in states], None if failure is None else error or failure)
    if failure is not None:
        if end_error is not None:
            add_note(bridge.own(error) or failure, f"on_trajectory_end also failed: {end_error!r}")
        _raise(failure, error, bridge)
    if end_error is not None:
        bridge.user_errors.append(end_error)
    failure = _agreed(gather_fn, rank, end_error)
    if failure is not None:
        _raise(failure, end_error, bridge)
    return [_finish(out, st, train_turns) for out, st in zip(outputs, states, strict=True)]


def _open(
    scheduler: MultiTurnScheduler,
    states: list[RequestState],
    chat: ChatFormat,
    bridge: SwiftBridge,
    limit: float | None,
) -> tuple[list[MultiTurnRequest], Exception | None]:
    """on_trajectory_start, then each request's first prompt; (prompts, this rank's error)."""
    requests = [st.request for st in states]
    try:
        asyncio.run(_start(scheduler, requests, limit))
    except Exception as exc:
        bridge.user_errors.append(exc)
        add_note(exc, f"raised by {type(scheduler).__name__}.on_trajectory_start")
        return [], exc
    for st in states:  # on_trajectory_start may have replaced a request in the list
        st.request = requests[st.position]
    try:
        return _first_requests(chat, states), None
    except Exception as exc:
        return [], exc


def _end(scheduler: MultiTurnScheduler, requests: list[RolloutInferRequest], error: BaseException | None):
    """Run on_trajectory_end; return what it raised (None if nothing)."""
    try:
        asyncio.run(maybe_await(scheduler.on_trajectory_end(requests, error)))
    except Exception as exc:
        add_note(exc, f"raised by {type(scheduler).__name__}.on_trajectory_end")
        return exc
    return None


def rollout_trajectories(
    scheduler: MultiTurnScheduler | object,
    rows: Sequence[Row],
    *,
    num_generations: int,
    engine: Engine,
    tokenizer: Tokenizer,
    sampling: SamplingParams,
    seed: int,
    gather_fn: GatherFn = local_gather,
    rank: int = 0,
    step_timeout_s: float | None = None,
    reward_key: str = "reward",
    max_turns: int | None = None,
    train_turns: TrainTurns = "all",
    on_sample_error: OnSampleError = "raise",
) -> list[Trajectory]:
    """The trainer's call: `run`, then one trajectory per request with `infos.env_reward`.

    `group` is the row's index on this rank (a row's samples share their advantage
    baseline); `infos.env_reward` is `rollout_infos[reward_key]` where the scheduler set
    it (the environment reward function reports the ones that lack it).
    """
    outputs = run(
        rows,
        scheduler,
        engine,
        tokenizer,
        sampling,
        num_generations=num_generations,
        max_turns=max_turns,
        seed=seed,
        gather_fn=gather_fn,
        rank=rank,
        step_timeout_s=step_timeout_s,
        train_turns=train_turns,
        on_sample_error=on_sample_error,
    )
    return [
        out.to_trajectory(group=out.native.request.data["group"], reward_key=reward_key) for out in outputs
    ]
