"""Turns: key/value reuse across turns (PrefixCachingEngine) versus re-encoding the history.

    python benchmarks/bench_turns.py --turns 2,4,8,16 --json

Both engines generate the same tokens (checked on every run); the re-encoding engine (HFEngine,
which is what a driver that re-templates the history gets) prefills the whole conversation
every turn, the reusing one only what was appended since its last turn. Medians of --repeats.
Prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse

import torch
from common import emit, make_convs, median, stop_free_policy, timed

from interlens_mcore import HFEngine, co_step
from interlens_mcore.assets import load_tiny
from interlens_mcore.engines.prefix_cache import PrefixCachingEngine


def run_once(engine, tok, n: int, turns: int, max_new: int) -> tuple[float, list]:
    if isinstance(engine, PrefixCachingEngine):
        engine.clear()  # conversation ids repeat across runs: start cold every time
        engine.reuse.reset()
    convs = make_convs(stop_free_policy(engine, tok, max_new), n, turns)
    wall, _ = timed(co_step, convs, turns=None)
    return wall, [m.token_ids for c in convs for m in c.messages if m.token_ids]


def measure(engines: dict, tok, n: int, turns: int, max_new: int, repeats: int) -> dict:
    walls = {name: [] for name in engines}
    same = True
    for _ in range(repeats):
        tokens = {}
        for name, engine in engines.items():
            wall, tokens[name] = run_once(engine, tok, n, turns, max_new)
            walls[name].append(wall)
        same &= tokens["reuse"] == tokens["reencode"]
    reuse, reencode = median(walls["reuse"]), median(walls["reencode"])
    stats = engines["reuse"].reuse
    return {
        "turns": turns,
        "reuse_s": reuse,
        "reencode_s": reencode,
        "speedup": round(reencode / reuse, 2),
        "prefill_tokens_reuse": stats.prefill_tokens,
        "reused_tokens": stats.reused_tokens,
        "same_tokens": same,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", default="2,4,8,16", help="comma-separated policy turns per conversation")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_tiny()
    engines = {"reencode": HFEngine(model, tok), "reuse": PrefixCachingEngine(model, tok)}
    run_once(engines["reuse"], tok, 4, 1, 4)  # warm-up
    rows = [
        measure(engines, tok, args.conversations, int(t), args.max_new_tokens, args.repeats)
        for t in args.turns.split(",")
    ]
    out = {
        "conversations": args.conversations,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "runs": rows,
        "speedup_at_8_turns": next((r["speedup"] for r in rows if r["turns"] == 8), None),
        "same_tokens": all(r["same_tokens"] for r in rows),
    }
    return emit(out, args.json)


if __name__ == "__main__":
    main()
