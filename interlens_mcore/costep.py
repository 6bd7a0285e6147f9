"""Lockstep co-stepping: every round each active conversation takes one turn; the policy turns
of conversations that share a schedule signature are generated together in left-padded waves.

Example::

    convs = [Conversation([policy, GuessEnv(secret)], prompt, run_until=MaxTurns(8))
             for secret in secrets]
    co_step(convs, turns=None, max_batch_size=32, group_seed=step)
    trajectories = [t for c in convs for t in c.trajectories()]
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from .conversation import Conversation, Environment, Policy
from .engine import Engine, Generation, GenerationRequest
from .limits import StepTimeout, await_limited, check_time_limit
from .sampling import mix_seed
from .trajectory import Message, Status
from .vote import GatherFn, cast_vote, local_gather

DEFAULT_MAX_ROUNDS = 1000


def schedule_signature(conv: Conversation, turns: int | None) -> tuple:
    """Who speaks in the next `turns` turns (the whole lineup cycle when None), as signatures.

    Conversations with equal signatures have interchangeable speakers at every round, so their
    policy turns can share one batch.
    """
    n = len(conv.lineup)
    span = n if turns is None else turns
    return tuple(conv.lineup[(conv.turns_taken + k) % n].signature() for k in range(span))


def _key(signature: tuple) -> str:
    # a digest that is the same on every rank (no object ids), used to align engine calls
    return hashlib.sha1(repr(signature).encode()).hexdigest()[:16]


def co_step(
    convs: Sequence[Conversation],
    turns: int | None = None,
    *,
    max_batch_size: int | None = None,
    group_seed: int = 0,
    gather_fn: GatherFn = local_gather,
    rank: int = 0,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    engines: Sequence[Engine] = (),
    step_timeout_s: float | None = None,
) -> list[Conversation]:
    """Advance every conversation by `turns` turns, or until its stop conditions fire (None).

    A round is one policy turn of every active conversation, generated together per schedule
    signature; the environment, tool and scripted turns in between run before it.

    With a distributed `gather_fn` (`parallel.build_groups(...).gather_fn()`) the ranks vote before each
    round; a rank with nothing left joins every engine call with an empty batch while any
    rank works, and a failure on one rank raises the same RolloutError on all of them.
    `engines` names engines a rank must be able to join even if it holds no conversation
    that uses them. With `turns` given, conversations still running after their `turns`
    turns end with status MAX_TURNS.

    `step_timeout_s` limits every environment / tool / scripted turn (an `Environment`'s own
    `timeout_s` wins). A turn past its limit ends that conversation with status TIMEOUT and
    commits nothing; its trajectories keep the turns before it, and the others carry on (it
    is not a failure). An async `respond` is cancelled at the limit; a sync one runs in a
    daemon thread, one at a time, and, as a thread cannot be killed, may finish later: what
    it returns is discarded, but it still runs, so it should not keep mutating the
    conversation. Without any limit sync responds run inline.
    """
    if turns is not None and turns < 0:
        raise ValueError(f"co_step: turns must be >= 0 or None, got {turns}")
    check_time_limit(step_timeout_s, "co_step: step_timeout_s")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"co_step: max_batch_size must be >= 1 or None, got {max_batch_size}")
    convs = list(convs)
    registry = {e.name: e for e in engines}
    registry.update({p.engine.name: p.engine for c in convs for p in c.policies()})
    error: BaseException | None = None
    try:
        for c in convs:
            c.start()
            for p in c.lineup:
                if isinstance(p, Environment):
                    check_time_limit(p.timeout_s, f"conversation {c.id}: participant {p.name!r} timeout_s")
        groups: dict[str, list[Conversation]] = defaultdict(list)
        for c in convs:
            if not c.finished:
                groups[_key(schedule_signature(c, turns))].append(c)
    except Exception as exc:  # carried in the first vote, so every rank fails alike
        error, groups = exc, {}
    # a conversation's own turn limit: `turns` more than it had on entry
    limit = {id(c): c.turns_taken + turns for c in convs} if turns is not None else {}

    def open_(c: Conversation) -> bool:
        return not c.finished and (turns is None or c.turns_taken < limit[id(c)])

    budget = turns if turns is not None else max_rounds
    for round_idx in range(budget + 1):
        if error is None:  # environment / tool turns first, so the vote sees who will generate
            try:
                _python_until_policy(convs, open_, max_rounds, step_timeout_s)
            except Exception as exc:
                error = exc
        # open conversations now face a policy (unless a Python turn just failed)
        active = {k: [c for c in g if open_(c) and isinstance(c.speaker, Policy)] for k, g in groups.items()}
        rows = {k: (g[0].speaker.engine.name, len(g)) for k, g in active.items() if g}
        done_turns = round_idx >= budget
        ballots = cast_vote(
            gather_fn,
            rank=rank,
            active=bool(rows) and not (done_turns and turns is not None),
            error=error,
            payload={"rows": rows},
        )
        if not any(b.active for b in ballots):
            break
        if done_turns:  # only reachable with turns=None: the safety bound, on every rank
            left = [c.id for g in active.values() for c in g][:5]
            raise RuntimeError(
                f"co_step(turns=None): conversations {left} still running after {max_rounds} "
                "rounds; give them stop conditions (run_until, stop_when) or pass turns"
            )
        try:
            _policy_round(active, ballots, registry, max_batch_size, group_seed)
        except Exception as exc:
            error = exc
    if turns is not None:
        for c in convs:
            c.end(Status.MAX_TURNS, "turns")
    return convs


def _python_until_policy(convs: list[Conversation], open_, bound: int, step_timeout_s: float | None) -> None:
    """Run environment / tool / scripted turns until every open conversation faces a policy.

    One vote per policy round, not per turn: Python turns need no collective, so they run
    between votes (their failures are carried by the next vote).
    """
    for _ in range(bound):
        waiting = [c for c in convs if open_(c) and not isinstance(c.speaker, Policy)]
        if not waiting:
            return
        asyncio.run(_python_turns(waiting, step_timeout_s))
    left = [c.id for c in convs if open_(c)][:5]
    raise RuntimeError(
        f"co_step: conversations {left} took {bound} turns without a policy turn or a stop; "
        "give them stop conditions (run_until, stop_when) or pass turns"
    )


def _policy_round(active, ballots, registry, max_batch_size, group_seed) -> None:
    """One policy turn for every active conversation; engine calls aligned across ranks by key."""
    calls = {k: v[0] for b in ballots for k, v in b.payload["rows"].items()}
    for key in sorted(calls):
        if calls[key] not in registry:
            raise ValueError(
                f"co_step: another rank generates with engine {calls[key]!r}, which this rank "
                "does not hold; pass it in co_step(engines=...)"
            )
        counts = [b.payload["rows"].get(key, ("", 0))[1] for b in ballots]
        width = max_batch_size or max(counts)
        waves = max(math.ceil(n / width) for n in counts)
        _policy_turns(registry[calls[key]], active.get(key, []), waves, width, group_seed)


def _policy_turns(engine: Engine, convs: list[Conversation], waves: int, width: int, group_seed: int) -> None:
    requests = []
    for c in convs:
        p: Policy = c.speaker  # type: ignore[assignment]
        cap = c.token_cap()
        cap = p.sampling.max_new_tokens if cap is None else min(cap, p.sampling.max_new_tokens)
        requests.append(
            GenerationRequest(
                prompt_ids=c.prompt_ids(p),
                max_new_tokens=cap,
                temperature=p.sampling.temperature,
                seed=mix_seed(group_seed, c.seed, c.turns_taken, c.lineup.index(p)),
                stop_token_ids=p.chat.stop_token_ids,
                tag=c.id,
            )
        )
    results: list[Generation] = []
    for w in range(waves):  # every rank makes the same number of calls; some may be empty
        results.extend(_generate_splitting(engine, requests[w * width : (w + 1) * width]))
    for c, gen in zip(convs, results, strict=True):
        p = c.speaker
        msg = Message(
            speaker=p.name,
            content=p.chat.decode(gen.token_ids),
            role="assistant",
            token_ids=list(gen.token_ids),
            logprobs=list(gen.logprobs),
            finish_reason=gen.finish_reason,
        )
        c.commit(p, msg, generated=len(gen.token_ids))


def _generate_splitting(engine, requests: list[GenerationRequest]) -> list[Generation]:
    """Generate a wave; on out-of-memory split it in halves and retry (rows are independent)."""
    try:
        return engine.generate(requests)
    except torch.OutOfMemoryError:
        # only safe for engines that are not collective: a split on one rank would desync
        if len(requests) <= 1:
            raise
        half = len(requests) // 2
        return _generate_splitting(engine, requests[:half]) + _generate_splitting(engine, requests[half:])


async def _python_turns(convs: list[Conversation], step_timeout_s: float | None) -> None:
    """Environment / tool / scripted turns, concurrently (they may await I/O)."""
    serial = asyncio.Lock()  # sync responds run one at a time, as they always have

    async def one(c: Conversation) -> None:
        try:
            await turn(c)
        except Exception as exc:  # the conversation that failed says so, as run_multi_turn's do
            c.end(Status.FAILED, f"{type(exc).__name__}: {exc}")
            raise

    async def turn(c: Conversation) -> None:
        speaker: Environment = c.speaker  # type: ignore[assignment]
        limit = speaker.timeout_s if speaker.timeout_s is not None else step_timeout_s
        try:
            out = await await_limited(speaker.respond, c, limit=limit, serial=serial)
        except StepTimeout:
            at = c.turns_taken + 1
            c.end(Status.TIMEOUT, f"timeout: {speaker.name} exceeded {limit:g} s at turn {at}")
            return
        if out is None:
            msg = None
        elif isinstance(out, Message):
            msg = out
        elif isinstance(out, str):
            msg = Message(speaker=speaker.name, content=out, role=speaker.role)
        else:
            raise ValueError(
                f"conversation {c.id}: participant {speaker.name!r} returned "
                f"{type(out).__name__}; expected str, Message or None"
            )
        c.commit(speaker, msg)

    await asyncio.gather(*(one(c) for c in convs))
