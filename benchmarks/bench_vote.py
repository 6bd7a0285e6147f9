"""The vote: cost per round and share of rollout time of co_step's termination vote on 2 ranks.

    torchrun --nproc_per_node=2 benchmarks/bench_vote.py --json

Each rank co-steps its own conversations on the tiny model; rank r's run for turns + r policy
turns, so the ranks finish in different rounds and the idle one keeps voting. The vote is
`distributed.build_groups(rollout="world").gather_fn()` (gloo side group), timed by wrapping it.
Before each vote a barrier lines the ranks up, so the vote's own cost is timed apart from
the wait for the slower rank (`wait_ms_per_round`, load imbalance, not counted as vote).
Rank 0 prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import emit, make_convs, median, stop_free_policy

from interlens_mcore import HFEngine, co_step, distributed
from interlens_mcore.assets import load_tiny


def timed_gather(gather, group):
    """The gather_fn, timed apart from the wait for the slower rank.

    A barrier first lines the ranks up (its seconds go to `.waits`: load imbalance, not the
    vote), then the vote itself is timed (`.calls`).
    """

    def wrapped(items):
        t0 = time.perf_counter()
        distributed.barrier(group)
        t1 = time.perf_counter()
        out = gather(items)
        wrapped.waits.append(t1 - t0)
        wrapped.calls.append(time.perf_counter() - t1)
        return out

    wrapped.calls, wrapped.waits = [], []
    return wrapped


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16, help="per rank")
    ap.add_argument("--turns", type=int, default=4, help="policy turns on rank 0 (rank r: turns + r)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the cores
    distributed.init_distributed()
    try:
        groups = distributed.build_groups(rollout="world")
        model, tok = load_tiny()
        engine = HFEngine(model, tok)
        policy = stop_free_policy(engine, tok, args.max_new_tokens)
        co_step(make_convs(policy, 2, 1, tag="warm"), gather_fn=groups.gather_fn(), rank=groups.rank)
        gather = timed_gather(groups.gather_fn(), groups.vote)
        convs = make_convs(policy, args.conversations, args.turns + groups.rank, tag=f"r{groups.rank}-")
        distributed.barrier()
        t0 = time.perf_counter()
        co_step(convs, gather_fn=gather, rank=groups.rank)
        wall = time.perf_counter() - t0 - sum(gather.waits)  # the rollout without the barriers
        rounds = len(gather.calls)
        out = {
            "ranks": groups.world_size,
            "conversations_per_rank": args.conversations,
            "rounds": rounds,
            "rollout_s": round(wall, 3),
            "vote_ms_per_round": round(1000 * sum(gather.calls) / rounds, 3),
            "vote_ms_median": round(1000 * median(gather.calls), 3),
            "turn_ms_per_round": round(1000 * (wall - sum(gather.calls)) / rounds, 3),
            "vote_fraction": round(sum(gather.calls) / wall, 4),
            "wait_ms_per_round": round(1000 * sum(gather.waits) / rounds, 3),
        }
        return emit(out, args.json) if groups.rank == 0 else None
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main()
