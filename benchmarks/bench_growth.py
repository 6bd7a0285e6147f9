"""Growth: co_step rollout wall time against the number of conversations and of turns.

    python benchmarks/bench_growth.py --conversations 1,4,16,64,256 --turns 1,2,4,8,16 --json

One sweep varies conversations at --fixed-turns, the other turns at --fixed-conversations,
both batched (co_step) with key/value reuse (PrefixCachingEngine) and without (HFEngine).
Prints one JSON object as the last line; launch/bench_plots.py draws it.
"""

from __future__ import annotations

import argparse

import torch
from common import emit, make_convs, stop_free_policy, timed

from interlens_mcore import HFEngine, co_step
from interlens_mcore.assets import load_tiny
from interlens_mcore.engines.prefix_cache import PrefixCachingEngine


def wall(engine, tok, n: int, turns: int, max_new: int) -> float:
    if isinstance(engine, PrefixCachingEngine):
        engine.clear()
    convs = make_convs(stop_free_policy(engine, tok, max_new), n, turns)
    return round(timed(co_step, convs, turns=None)[0], 4)


def sweep(engines: dict, tok, points: list[tuple[int, int]], max_new: int) -> list[dict]:
    return [
        {
            "conversations": n,
            "turns": t,
            **{f"{k}_s": wall(e, tok, n, t, max_new) for k, e in engines.items()},
        }
        for n, t in points
    ]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", default="1,4,16,64,256")
    ap.add_argument("--turns", default="1,2,4,8,16")
    ap.add_argument("--fixed-turns", type=int, default=4)
    ap.add_argument("--fixed-conversations", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_tiny()
    engines = {"reuse": PrefixCachingEngine(model, tok), "reencode": HFEngine(model, tok)}
    wall(engines["reuse"], tok, 4, 1, 4)  # warm-up
    by_convs = [(int(n), args.fixed_turns) for n in args.conversations.split(",")]
    by_turns = [(args.fixed_conversations, int(t)) for t in args.turns.split(",")]
    out = {
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "by_conversations": sweep(engines, tok, by_convs, args.max_new_tokens),
        "by_turns": sweep(engines, tok, by_turns, args.max_new_tokens),
    }
    return emit(out, args.json)


if __name__ == "__main__":
    main()
