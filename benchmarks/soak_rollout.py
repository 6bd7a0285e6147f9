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
import faulthandler
import os
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from common import emit
from soak_checks import Recorder
from soak_plan import DRIVERS, Context, Plan, make_plan, run_once

from interlens_mcore import ChatFormat, HFEngine, distributed
from interlens_mcore.assets import load_tiny

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
    distributed.init_distributed(timeout_s=args.run_deadline_s)
    try:
        groups = distributed.build_groups(rollout="world", vote_timeout_s=args.vote_timeout_s)
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
            results = distributed.all_gather_object(asdict(run_once(plan, ctx)))
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
        distributed.destroy()


if __name__ == "__main__":
    main()
