"""Soak: many randomised rollouts on 2 ranks; nothing hangs, every failure surfaces, nothing is lost.

    torchrun --nproc_per_node=2 benchmarks/soak_rollout.py --runs 200 --json

Runs alternate between the two drivers: `co_step` (a policy and an environment in a lineup)
and `run_multi_turn` (a tool scheduler with async hooks), both over the real `HFEngine` on
the tiny model, its forwards in lockstep over the ranks (`sync_group`, as for ZeRO-3): a rank
that skipped or repeated an engine call would hang the other instead of passing unnoticed.

Per run and rank, drawn at random: the number of conversations, each one's turn limit and
token cap, environment latencies and early stops. Some environment steps sleep past
`step_timeout_s` (their conversation must end TIMEOUT and still yield its trajectory). Some
runs make one rank raise at one turn; every rank must then catch a RolloutError that names
that rank and that message. What every rank must agree on (driver, failing rank and turn,
batch width, seeds) comes from a per-run RNG; the rest from a per-(run, rank) RNG.

Every trajectory, of successful and failed runs alike, is checked against a recording of what
the engine was given and returned: sampled ids, loss mask, rollout logprobs, the prompt at
every turn, the turn count; then the packed training tensors built from them. A watchdog ends
a run past its deadline with every thread's stack on stderr, and rank 0 still prints the JSON
line with the hang counted. Rank 0 prints progress to stderr and one JSON object as the last
line of stdout.

`--engine-failures` also makes the failing rank raise inside its engine call, before it joins
the lockstep forwards. With lockstep engines that hangs the other rank in the engine's
all-reduce until the vote's timeout (the vote cannot carry an error raised inside a
collective); with `--independent-engines` (no `sync_group`) such failures surface like the
others.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from common import emit

from interlens_mcore import (
    ChatFormat,
    Conversation,
    EngineRollout,
    Environment,
    HFEngine,
    MaxTurns,
    Message,
    MultiTurnError,
    MultiTurnRequest,
    MultiTurnScheduler,
    Policy,
    RolloutError,
    SamplingParams,
    Status,
    build_batch,
    co_step,
    parallel,
    run_multi_turn,
)
from interlens_mcore.assets import load_tiny
from interlens_mcore.vote import GatherFn

DRIVERS = ("co_step", "run_multi_turn")
MAX_POLICY_TURNS = 5
TOKEN_CAPS = (3, 6)  # max_new_tokens is drawn from this range
# counters kept per driver; the ones after the first three are summed straight from RankResult
PER_DRIVER = ("runs", "failures", "trajectories", "timeouts", "slow_steps", "missed_timeouts", "early_stops")
# RankResult counters summed into the totals as they are
SUMMED = (
    "bad_status",
    "timeouts",
    "slow_steps",
    "missed_timeouts",
    "unplanned_timeouts",
    "early_stops",
    "engine_calls",
)


# --- the engine, recorded ---------------------------------------------------------------------


@dataclass
class Call:
    """One row of one generate call: what the engine conditioned on and what it sampled."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]


class Recorder:
    """Forwards to the real engine; logs per request tag (conversation id, "request {i}")
    every row it was given and what it returned, in order. The ground truth of the checks."""

    def __init__(self, engine: HFEngine):
        self.engine, self.name, self.max_context = engine, engine.name, engine.max_context
        self.calls: dict[str, list[Call]] = defaultdict(list)
        self.generate_calls = 0
        self.before: Callable[[list[int]], None] | None = None  # sees the rows' turns first

    def reset(self, before: Callable[[list[int]], None] | None = None) -> None:
        self.calls.clear()
        self.generate_calls = 0
        self.before = before

    def generate(self, requests):
        if self.before is not None:  # may raise before this rank joins the lockstep forwards
            self.before([len(self.calls[r.tag]) + 1 for r in requests])
        out = self.engine.generate(requests)
        self.generate_calls += 1
        for r, g in zip(requests, out, strict=True):
            self.calls[r.tag].append(Call(list(r.prompt_ids), list(g.token_ids), list(g.logprobs)))
        return out


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


# --- checks against the recording -------------------------------------------------------------


def check_tokens(traj, sampled: list[tuple[int, int]], calls: list[Call]) -> list[str]:
    """Sampled ranges [s, e) of a trajectory against the engine's calls for it, in order."""
    ids, problems = traj.token_ids, []
    for k, ((s, e), call) in enumerate(zip(sampled, calls), 1):
        if ids[s:e] != call.token_ids:
            problems.append(f"turn {k}: trained ids {ids[s:e]} != engine's {call.token_ids}")
        if ids[:s] != call.prompt_ids:  # token-space exactness: what the engine conditioned on
            problems.append(
                f"turn {k}: trajectory prefix ({s} ids) != engine prompt ({len(call.prompt_ids)})"
            )
    mask = [0] * len(ids)
    for s, e in sampled:
        mask[s:e] = [1] * (e - s)
    if traj.loss_mask != mask:
        problems.append("loss mask is not 1 exactly on the sampled ids")
    logprobs = [x for call in calls[: len(sampled)] for x in call.logprobs]
    complete = len(logprobs) == sum(mask)  # the completeness rule
    if traj.rollout_logprobs != (logprobs if complete else None):
        problems.append(f"rollout logprobs differ from the engine's (complete={complete})")
    return problems


def check_conversation(conv: Conversation, traj, calls: list[Call], commits: Counter) -> list[str]:
    policy = conv.lineup[0]
    opener = policy.chat.generation_prompt_ids()
    sampled = [(span.start + len(opener), span.end) for span in traj.turns]
    problems = check_tokens(traj, sampled, calls)
    for k, span in enumerate(traj.turns, 1):
        if traj.token_ids[span.start : span.start + len(opener)] != opener:
            problems.append(f"turn {k}: span does not start with the assistant opener")
    if not len(traj.turns) == len(calls) == commits["policy"]:
        problems.append(
            f"{len(traj.turns)} trained turns, {len(calls)} engine calls, {commits['policy']} commits"
        )
    if not traj.infos["turns"] == conv.turns_taken == sum(commits.values()):
        problems.append(
            f"infos turns {traj.infos['turns']}, turns_taken {conv.turns_taken}, commits {commits}"
        )
    if traj.status != conv.status or traj.infos["conversation"] != conv.id:
        problems.append("trajectory status or conversation id differ from the conversation's")
    return problems


def check_output(out, traj, calls: list[Call]) -> list[str]:
    sampled = [(span.start, span.end) for span in traj.turns]
    problems = check_tokens(traj, sampled, calls)
    # a request that failed in its hook or step made the engine call but keeps no turn for it
    unrecorded = 1 if out.status is Status.FAILED else 0
    if not len(sampled) == out.num_turns == len(calls) - unrecorded:
        problems.append(f"{len(sampled)} trained turns, num_turns {out.num_turns}, {len(calls)} engine calls")
    if not all(span.trained for span in traj.turns):
        problems.append("an untrained response span")
    return problems


def check_batch(trajs: list) -> list[str]:
    """The packed training tensors: targets at loss positions are the sampled ids, the old
    logprobs sit on the same positions in the same order."""
    trainable = [t for t in trajs if sum(t.loss_mask)]
    if not trainable:
        return []
    try:
        batch = build_batch(trainable, torch.zeros(len(trainable)), layout="packed", pad_to_multiple=8)
    except ValueError as exc:
        return [f"build_batch: {exc}"]
    problems = []
    for i, t in enumerate(trainable):
        a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        ids = torch.tensor(t.token_ids)  # [L]
        want_mask = torch.tensor(t.loss_mask[1:] + [0], dtype=torch.bool)  # position p predicts p + 1
        mask = batch.loss_mask[0, a:b]
        if not torch.equal(mask, want_mask):
            problems.append(f"batch sample {i}: loss positions differ from the mask shifted by one")
            continue
        if not torch.equal(batch.targets[0, a:b][mask], ids[1:][want_mask[:-1]]):
            problems.append(f"batch sample {i}: targets at loss positions are not the sampled ids")
        old = batch.rollout_logprobs[0, a:b][mask]
        want = torch.tensor(t.rollout_logprobs or [0.0] * int(mask.sum()), dtype=torch.float32)
        if not torch.equal(old, want) or bool(batch.logprobs_complete[i]) != t.logprobs_complete:
            problems.append(f"batch sample {i}: old logprobs do not line up with the trajectory's")
    return problems


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


# --- totals over runs -------------------------------------------------------------------------


@dataclass
class Totals:
    """The soak's counters, the same on every rank (built from gathered results)."""

    seed: int
    runs: int = 0
    hangs: int = 0
    injected_failures: int = 0
    surfaced_failures: int = 0
    unexpected_errors: int = 0
    trajectories: int = 0
    misaligned_trajectories: int = 0
    lost_trajectories: int = 0
    bad_status: int = 0
    timeouts: int = 0
    slow_steps: int = 0
    missed_timeouts: int = 0
    unplanned_timeouts: int = 0
    early_stops: int = 0
    engine_calls: int = 0  # generate calls, summed over ranks (idle ranks' empty calls included)
    slowest_run_s: float = 0.0
    drivers: dict = field(default_factory=lambda: {d: Counter(dict.fromkeys(PER_DRIVER, 0)) for d in DRIVERS})
    t0: float = field(default_factory=time.perf_counter)

    def add(self, plan: Plan, results: list[dict]) -> list[str]:
        """Count one run (every rank's result); returns lines worth printing to stderr."""
        d, notes = self.drivers[plan.driver], []
        self.runs += 1
        d["runs"] += 1
        raised = [r["raised"] for r in results if r["raised"]]
        if raised:
            self.injected_failures += 1
            d["failures"] += 1
            if all(
                r["caught"] and any(rank == plan.fail_rank and raised[0] in msg for rank, msg in r["caught"])
                for r in results
            ):
                self.surfaced_failures += 1
            else:
                notes.append(
                    f"run {plan.run}: injected {raised[0]!r}, caught {[r['caught'] for r in results]}"
                )
        for r in results:
            named = [m for _, m in r["caught"] or [] if not (raised and raised[0] in m)]
            if r["unexpected"] or named:
                self.unexpected_errors += 1
                notes.append(f"run {plan.run} rank {r['rank']}: {r['unexpected'] or named}")
            self.hangs += r["hang"]
            self.trajectories += r["recovered"]
            self.lost_trajectories += r["expected"] - r["recovered"]
            self.misaligned_trajectories += r["misaligned"]
            for key in SUMMED:
                setattr(self, key, getattr(self, key) + r[key])
            for key in PER_DRIVER[3:]:
                d[key] += r[key]
            d["trajectories"] += r["recovered"]
            self.slowest_run_s = max(self.slowest_run_s, round(r["wall_s"], 2))
            notes.extend(f"run {plan.run} rank {r['rank']}: {p}" for p in r["problems"])
        return notes

    def summary(self, **extra) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("drivers", "t0")}
        out["drivers"] = {k: dict(v) for k, v in self.drivers.items()}
        out["wall_s"] = round(time.perf_counter() - self.t0, 1)
        return {**out, **extra}

    def progress(self, total: int) -> str:
        return (
            f"soak: run {self.runs}/{total}, {self.hangs} hangs, {self.surfaced_failures}/"
            f"{self.injected_failures} failures surfaced, {self.timeouts} timeouts, "
            f"{self.misaligned_trajectories} misaligned, {self.lost_trajectories} lost, "
            f"{time.perf_counter() - self.t0:.0f} s"
        )


class Watchdog:
    """Ends a run that outlives its deadline: every thread's stack to stderr; rank 0 prints the
    JSON line with the hang counted first, the other ranks exit a little later (torchrun stops
    the rest when one exits). faulthandler is armed behind it in case no Python thread runs."""

    def __init__(self, rank: int, deadline_s: float, totals: Totals, quiet: bool):
        self.rank, self.deadline_s, self.totals, self.quiet = rank, deadline_s, totals, quiet
        self.timer: threading.Timer | None = None
        self.run = -1

    def arm(self, run: int) -> None:
        self.run = run
        delay = self.deadline_s + (0 if self.rank == 0 else 15)
        self.timer = threading.Timer(delay, self._fire)
        self.timer.daemon = True
        self.timer.start()
        faulthandler.dump_traceback_later(delay + 60, exit=True)

    def disarm(self) -> None:
        self.timer.cancel()
        faulthandler.cancel_dump_traceback_later()

    def _fire(self) -> None:
        print(
            f"soak: rank {self.rank}: run {self.run} ran past {self.deadline_s:.0f} s: hang", file=sys.stderr
        )
        faulthandler.dump_traceback(all_threads=True)
        if self.rank == 0:
            self.totals.hangs += 1
            emit(self.totals.summary(aborted_at_run=self.run), self.quiet)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="tiny model folder (default: built under the asset dir)")
    ap.add_argument("--max-conversations", type=int, default=6, help="per rank and run (1 to this)")
    ap.add_argument("--p-fail", type=float, default=0.3, help="chance a run injects a failure")
    ap.add_argument("--p-slow", type=float, default=0.25, help="chance a rank plans one slow step per run")
    ap.add_argument("--p-stop", type=float, default=0.12, help="chance an environment step stops early")
    ap.add_argument("--max-latency-s", type=float, default=0.004, help="ordinary step latency, 0 to this")
    ap.add_argument("--step-timeout-s", type=float, default=0.05, help="per-step time limit")
    ap.add_argument("--slow-step-s", type=float, default=0.2, help="how long a slow step sleeps")
    ap.add_argument("--vote-timeout-s", type=float, default=30.0)
    ap.add_argument("--run-deadline-s", type=float, default=60.0, help="a run past this is a hang")
    ap.add_argument(
        "--engine-failures",
        action="store_true",
        help="also inject failures in a rank's engine call, before it joins the lockstep forwards",
    )
    ap.add_argument(
        "--independent-engines",
        action="store_true",
        help="each rank's HFEngine forwards on its own (no sync_group): engine calls are not collective",
    )
    ap.add_argument("--progress-every", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the cores
    # torchrun stops the other ranks with SIGTERM when one exits: show where they were
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    parallel.init_distributed(timeout_s=args.run_deadline_s)
    try:
        groups = parallel.build_groups(rollout="world", vote_timeout_s=args.vote_timeout_s)
        rank, world = groups.rollout_rank, groups.world_size
        model, tok = load_tiny(args.model)
        # forwards in lockstep over the ranks: a misaligned engine call hangs instead of passing
        sync = None if args.independent_engines else groups.rollout
        engine = Recorder(HFEngine(model, tok, sync_group=sync))
        ctx = Context(args, rank, engine, tok, ChatFormat(tok), groups.gather_fn())
        totals = Totals(seed=args.seed)
        watchdog = Watchdog(rank, args.run_deadline_s, totals, args.json)
        for run in range(args.runs):
            plan = make_plan(args.seed, run, world, args.p_fail, args.engine_failures)
            watchdog.arm(run)
            results = parallel.all_gather_object(asdict(run_once(plan, ctx)))
            watchdog.disarm()
            notes = totals.add(plan, results)
            if rank == 0:
                for line in notes[:6]:
                    print(f"soak: {line}", file=sys.stderr)
                if (run + 1) % args.progress_every == 0 or run + 1 == args.runs:
                    print(totals.progress(args.runs), file=sys.stderr, flush=True)
            if any(r["hang"] for r in results):  # the ranks' collectives may be out of step now
                break
        out = totals.summary(ranks=world)
        return emit(out, args.json) if rank == 0 else None
    finally:
        parallel.destroy()


if __name__ == "__main__":
    main()
