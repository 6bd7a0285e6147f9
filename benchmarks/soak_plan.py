"""One soak run on one rank: the plan every rank agrees on, the chaos (latencies, early stops,
slow steps, the injected failure) in the environments and the scheduler, and the two drivers
(`co_step`, `run_multi_turn`) that carry a plan out and check what comes back."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from soak_checks import Recorder, check_batch, check_conversation, check_output

from interlens_mcore import (
    ChatFormat,
    Conversation,
    EngineRollout,
    Environment,
    MaxTurns,
    Message,
    MultiTurnError,
    MultiTurnRequest,
    MultiTurnScheduler,
    Policy,
    RolloutError,
    SamplingParams,
    Status,
    co_step,
    run_multi_turn,
)
from interlens_mcore.rollout.vote import GatherFn

DRIVERS = ("co_step", "run_multi_turn")
MAX_POLICY_TURNS = 5
TOKEN_CAPS = (3, 6)  # max_new_tokens is drawn from this range


# --- what a run does --------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What every rank agrees on for one run (drawn from the run's own RNG)."""

    run: int
    driver: str
    group_seed: int
    max_batch_size: int | None  # co_step's wave width: must be equal on every rank
    max_new_tokens: int  # run_multi_turn's request config (co_step draws one per conversation)
    fail_rank: int | None  # the rank that raises, or None
    fail_turn: int  # ... when one of its conversations reaches this policy turn
    fail_at: str  # ... in the environment's "respond", the scheduler's "hook" or "step", or the "engine"


def make_plan(seed: int, run: int, world: int, p_fail: float, engine_failures: bool = False) -> Plan:
    rng = random.Random(f"plan:{seed}:{run}")
    driver = DRIVERS[run % len(DRIVERS)]
    fail = rng.random() < p_fail
    sites = ["respond"] if driver == "co_step" else ["hook", "step"]
    fail_at = rng.choice(sites + ["engine"] * engine_failures)
    fail_turn = rng.randint(1, MAX_POLICY_TURNS)
    if fail_at == "engine" and driver == "run_multi_turn":  # its turn 1 is generated before it runs
        fail_turn = max(fail_turn, 2)
    return Plan(
        run=run,
        driver=driver,
        group_seed=rng.randrange(2**31),
        max_batch_size=rng.choice([None, 1, 2, 4]),
        max_new_tokens=rng.randint(*TOKEN_CAPS),
        fail_rank=rng.randrange(world) if fail else None,
        fail_turn=fail_turn,
        fail_at=fail_at,
    )


class InjectedFailure(RuntimeError):
    """The failure a soak run injects on purpose."""


class Chaos:
    """One rank's randomness in one run: latencies, early stops, slow steps and the failure."""

    def __init__(self, plan: Plan, rank: int, args: argparse.Namespace):
        self.name = f"{args.seed}:{plan.run}:{rank}"
        self.rng = random.Random(f"rank:{self.name}")  # set-up draws, made in a fixed order
        self.args = args
        self.fail_turn = plan.fail_turn if plan.fail_rank == rank else None
        self.message = f"injected failure run {plan.run} rank {rank} turn {plan.fail_turn}"
        self.raised = False
        self.slow: tuple[str, int, str] | None = None  # (conversation key, turn, where) of a slow step
        self.slow_begun: set[str] = set()  # keys whose slow step started

    def plan_slow(self, keys: list[str], where: str) -> None:
        """Maybe make one step run past the limit: an environment's "respond", a "hook" or a "step"."""
        if self.rng.random() < self.args.p_slow:
            self.slow = (self.rng.choice(keys), self.rng.randint(1, MAX_POLICY_TURNS), where)

    def step_rng(self, key: str, turn: int) -> random.Random:
        """The draws of one step. Steps run concurrently and finish in an order set by the
        clock, so a shared RNG would make a seed's early stops depend on timing."""
        return random.Random(f"step:{self.name}:{key}:{turn}")

    def is_slow(self, key: str, turn: int, where: str) -> bool:
        return self.slow == (key, turn, where)

    def delay(self, key: str, turn: int, where: str) -> float:
        """A step's latency: a few ms, or past the step time limit for the slow step."""
        if self.is_slow(key, turn, where):
            self.slow_begun.add(key)
            return self.args.slow_step_s
        return self.step_rng(key, turn).uniform(0.0, self.args.max_latency_s)

    def maybe_fail(self, turn: int) -> None:
        if turn == self.fail_turn and not self.raised:  # once per run: one named failure
            self.raised = True
            raise InjectedFailure(self.message)

    def engine_rows(self, turns: list[int]) -> None:
        """The engine's failure: raised when a row asks for the failing turn."""
        for turn in turns:
            self.maybe_fail(turn)

    def stop_early(self, key: str, turn: int) -> bool:
        return self.step_rng(f"stop {key}", turn).random() < self.args.p_stop


class ChaoticEnv(Environment):
    """co_step's environment: answers every policy turn after a random latency; may stop the
    conversation early, run past the step limit, or raise the run's injected failure."""

    name = "env"

    def __init__(self, chaos: Chaos):
        self.chaos = chaos

    async def respond(self, conv: Conversation) -> str:
        turn = sum(m.speaker == "policy" for m in conv.messages)  # policy turns so far
        await asyncio.sleep(self.chaos.delay(conv.id, turn, "respond"))  # cancelled at the limit
        return self.answer(conv, turn)

    def answer(self, conv: Conversation, turn: int) -> str:
        self.chaos.maybe_fail(turn)
        if self.chaos.stop_early(conv.id, turn):
            conv.request_stop("early")
        return f"hint {turn}: {'higher' if turn % 2 else 'lower'}"


class SyncChaoticEnv(ChaoticEnv):
    """The same environment with a synchronous `respond`, which co_step runs in a thread under
    a time limit (another schedule signature, too, so co_step aligns more engine calls)."""

    def respond(self, conv: Conversation) -> str | None:
        turn = sum(m.speaker == "policy" for m in conv.messages)
        time.sleep(self.chaos.delay(conv.id, turn, "respond"))
        if self.chaos.is_slow(conv.id, turn, "respond"):
            return None  # co_step gave up on this thread long ago; it must not touch conv now
        return self.answer(conv, turn)


class ChaoticScheduler(MultiTurnScheduler):
    """run_multi_turn's scheduler: a tool reply after every turn, each request's own turn
    limit, random hook latency and early `done`; raises the injected failure in its hook or
    its step."""

    def __init__(self, chat: ChatFormat, chaos: Chaos, fail_at: str):
        super().__init__(chat)
        self.chaos, self.fail_at = chaos, fail_at

    async def on_turn_end(self, request, response_choice, current_turn):
        await asyncio.sleep(self.chaos.delay(f"request {request.index}", current_turn, "hook"))
        if self.fail_at == "hook":
            self.chaos.maybe_fail(current_turn)
        if current_turn >= request.data["turns"]:
            return {"done": True}
        if self.chaos.stop_early(f"request {request.index}", current_turn):
            return {"done": True, "rollout_infos": {"early_stop": current_turn}}
        return {"done": False}  # decide here: a reply cut at its token cap does not end it

    def step(self, request, response_choice, current_turn):
        key = f"request {request.index}"
        reply = self.reply(request, response_choice, f"tool result {current_turn}", role="tool")
        time.sleep(self.chaos.delay(key, current_turn, "step"))  # runs in a thread under the limit
        # a slow step's thread outlives its limit and its result is dropped: it must not fail then
        if self.fail_at == "step" and not self.chaos.is_slow(key, current_turn, "step"):
            self.chaos.maybe_fail(current_turn)
        return {"infer_request": reply}


# --- one run on one rank ----------------------------------------------------------------------


@dataclass
class RankResult:
    """What one rank saw in one run; gathered to every rank after the run."""

    rank: int
    expected: int = 0  # conversations / requests started
    recovered: int = 0  # trajectories got back (one per conversation / request)
    misaligned: int = 0
    problems: list[str] = field(default_factory=list)  # the first few, for stderr
    bad_status: int = 0  # a finished run left a conversation RUNNING or FAILED
    timeouts: int = 0  # conversations / requests that ended TIMEOUT
    slow_steps: int = 0  # planned slow steps that started
    missed_timeouts: int = 0  # a slow step that did not end its conversation TIMEOUT
    unplanned_timeouts: int = 0  # TIMEOUT without a slow step (the machine was slower than the limit)
    early_stops: int = 0
    engine_calls: int = 0
    raised: str | None = None  # the injected failure's message, if this rank raised it
    caught: list[tuple[int, str]] | None = None  # failures of the RolloutError this rank caught
    unexpected: str | None = None  # any other exception escaping the driver
    hang: bool = False  # a collective timed out
    wall_s: float = 0.0

    def note(self, key: str, problems: list[str]) -> None:
        if problems:
            self.misaligned += 1
            self.problems.extend(f"{key}: {p}" for p in problems[:2])


@dataclass
class Context:
    """What stays the same across runs on this rank."""

    args: argparse.Namespace
    rank: int
    engine: Recorder
    tok: Any
    chat: ChatFormat
    gather: GatherFn
    policies: dict[int, Policy] = field(default_factory=dict)

    def policy(self, max_new_tokens: int) -> Policy:
        # one Policy per token cap: conversations with different caps are different schedule
        # signatures, so co_step aligns several engine calls per round over the ranks
        if max_new_tokens not in self.policies:
            sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
            self.policies[max_new_tokens] = Policy("policy", self.engine, self.tok, sampling)
        return self.policies[max_new_tokens]


def _opening(rng: random.Random) -> str:
    return f"guess the number between one and {rng.randint(2, 100)}"


def run_costep(plan: Plan, chaos: Chaos, ctx: Context, res: RankResult) -> None:
    rng, commits = chaos.rng, defaultdict(Counter)

    def count(conv: Conversation, msg: Message) -> Message:
        commits[conv.id][msg.speaker] += 1
        return msg

    convs = []
    for i in range(rng.randint(1, ctx.args.max_conversations)):
        policy = ctx.policy(rng.randint(*TOKEN_CAPS))
        turns = 2 * rng.randint(1, MAX_POLICY_TURNS) - rng.randint(0, 1)  # ends on either speaker
        convs.append(
            Conversation(
                [policy, rng.choice([ChaoticEnv, SyncChaoticEnv])(chaos)],
                [Message(speaker="user", content=_opening(rng))],
                run_until=MaxTurns(turns),
                hooks=[count],
                id=f"run{plan.run}-rank{ctx.rank}-conv{i}",
            )
        )
    chaos.plan_slow([c.id for c in convs], "respond")
    res.expected = len(convs)
    try:
        co_step(
            convs,
            turns=None,
            max_batch_size=plan.max_batch_size,
            group_seed=plan.group_seed,
            gather_fn=ctx.gather,
            rank=ctx.rank,
            engines=[ctx.engine],
            step_timeout_s=ctx.args.step_timeout_s,
        )
    except RolloutError as err:
        res.caught = err.failures
    trajs = []
    for c in convs:  # the caller holds every conversation, failed run or not
        try:
            got = c.trajectories()
        except Exception as exc:  # a trajectory that cannot be built is lost
            res.problems.append(f"{c.id}: trajectories() raised {exc!r}")
            continue
        if len(got) != 1:
            res.problems.append(f"{c.id}: {len(got)} trajectories for one trainable policy")
            continue
        res.recovered += 1
        trajs.append(got[0])
        res.note(c.id, check_conversation(c, got[0], ctx.engine.calls[c.id], commits[c.id]))
        res.early_stops += c.stop_reason == "early"
    statuses = {c.id: c.status for c in convs}
    _tally_status(res, chaos, statuses, ok={Status.STOPPED, Status.TIMEOUT})
    res.note(f"run {plan.run} batch", check_batch(trajs))


def run_turns(plan: Plan, chaos: Chaos, ctx: Context, res: RankResult) -> None:
    rng = chaos.rng
    requests = [
        MultiTurnRequest.from_messages(
            ctx.chat,
            [{"role": "user", "content": _opening(rng)}],
            index=1000 * ctx.rank + i,
            data={"turns": rng.randint(1, MAX_POLICY_TURNS)},
        )
        for i in range(rng.randint(1, ctx.args.max_conversations))
    ]
    chaos.plan_slow([f"request {r.index}" for r in requests], rng.choice(["hook", "step"]))
    res.expected = len(requests)
    rollout = EngineRollout(ctx.engine, ctx.chat, seed=plan.group_seed)
    config = SamplingParams(temperature=1.0, max_new_tokens=plan.max_new_tokens)
    first = rollout(requests, config)  # the first turn, as a trainer's first generate call makes it
    scheduler = ChaoticScheduler(ctx.chat, chaos, plan.fail_at)
    try:
        outs = run_multi_turn(
            requests,
            first,
            scheduler,
            rollout,
            config,
            MAX_POLICY_TURNS,
            ctx.gather,
            rank=ctx.rank,
            step_timeout_s=ctx.args.step_timeout_s,
        )
    except MultiTurnError as err:  # keeps this rank's work, one output per request
        res.caught, outs = err.failures, err.outputs
    trajs, statuses = [], {}
    for req, out in zip(requests, outs):  # outputs are in request order
        key = f"request {req.index}"
        if out.request.index != req.index:
            res.problems.append(f"{key}: output for request {out.request.index} in its place")
            continue
        try:
            traj = out.to_trajectory()
        except Exception as exc:
            res.problems.append(f"{key}: to_trajectory() raised {exc!r}")
            continue
        res.recovered += 1
        trajs.append(traj)
        statuses[key] = out.status
        res.note(key, check_output(out, traj, ctx.engine.calls[key]))
        res.early_stops += "early_stop" in out.rollout_infos
    _tally_status(res, chaos, statuses, ok={Status.STOPPED, Status.MAX_TURNS, Status.TIMEOUT})
    res.note(f"run {plan.run} batch", check_batch(trajs))


def _tally_status(res: RankResult, chaos: Chaos, statuses: dict, ok: set) -> None:
    timed_out = {k for k, s in statuses.items() if s is Status.TIMEOUT}
    res.timeouts, res.slow_steps = len(timed_out), len(chaos.slow_begun)
    if res.caught is None:  # in a failed run a slow step may have been cut short by the failure
        res.missed_timeouts = len(chaos.slow_begun - timed_out)
        res.bad_status = sum(s not in ok for s in statuses.values())
    res.unplanned_timeouts = len(timed_out - chaos.slow_begun)


def run_once(plan: Plan, ctx: Context) -> RankResult:
    res, chaos = RankResult(rank=ctx.rank), Chaos(plan, ctx.rank, ctx.args)
    ctx.engine.reset(before=chaos.engine_rows if plan.fail_at == "engine" else None)
    t0 = time.perf_counter()
    try:
        (run_costep if plan.driver == "co_step" else run_turns)(plan, chaos, ctx, res)
    except Exception as exc:  # not a RolloutError: a collective timed out, or a bug
        res.unexpected = f"{type(exc).__name__}: {exc}"[:500]
        res.hang = "timed out" in str(exc).lower() or "timeout" in type(exc).__name__.lower()
        # now, not after the gather: if the other rank is stuck, that gather never returns
        stack = "".join(traceback.format_exception(exc))
        print(f"soak: rank {ctx.rank} run {plan.run}: {stack}", file=sys.stderr, flush=True)
    res.raised = chaos.message if chaos.raised else None
    res.engine_calls = ctx.engine.generate_calls
    res.wall_s = time.perf_counter() - t0
    res.problems = res.problems[:4]
    return res
