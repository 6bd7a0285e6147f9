"""Overlap: environment and tool turns that take time, with and without co_step's overlap.

    python benchmarks/bench_overlap.py --json
    python benchmarks/bench_overlap.py --latency-ms 0,100,500 --overlap 1,2,4 --json

An async environment answers every policy turn after `latency` milliseconds (`asyncio.sleep`: a
remote tool, a sandbox, a search call), with the same short feedback as the other rollout
benchmarks. --conversations x --turns policy turns of --max-new-tokens tokens each go through
`co_step` with HFEngine on the tiny model (or Qwen2 12M, `--model qwen2-12m`), once per overlap
setting (1: off), repetitions interleaved; tokens per second are the medians. Every run's
tokens are checked equal to the run without overlap. Prints one JSON object as the last line,
with the machine's load before and after; `speedup` is each overlap's tokens per second over
overlap 1's at that latency, and `engine_s` the seconds inside the model's forwards: overlap
pays off only where a slice's smaller calls cost less than the whole round's (generation bound
by compute, not by the cost of a call).
"""

from __future__ import annotations

import argparse
import asyncio

import torch
from common import emit, median, stop_free_policy, timed

from interlens_mcore import Conversation, Environment, HFEngine, MaxTurns, Message, co_step
from interlens_mcore.assets import ensure_tiny_model, load_tiny

MODELS = {  # as in bench_engines.py
    "tiny": {},
    "qwen2-12m": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6),
}


class SlowFeedback(Environment):
    """Feedback after `latency_s` of waiting on something else (the event loop stays free)."""

    name = "env"

    def __init__(self, secret: int, latency_s: float):
        self.secret, self.latency_s = secret, latency_s

    async def respond(self, conv):
        await asyncio.sleep(self.latency_s)
        return f"{self.secret} is higher" if conv.turns_taken % 4 == 1 else "lower"


def run_once(engine, tok, args, latency_s: float, overlap: int) -> tuple[float, float, list]:
    policy = stop_free_policy(engine, tok, args.max_new_tokens)
    convs = [
        Conversation(
            [policy, SlowFeedback(i, latency_s)],
            [Message(speaker="user", content=f"guess the number {i}")],
            run_until=MaxTurns(2 * args.turns),
            id=f"bench{i}",
        )
        for i in range(args.conversations)
    ]
    engine.stats.reset()
    wall, _ = timed(co_step, convs, turns=None, overlap=overlap)
    return wall, engine.stats.forward_s, [m.token_ids for c in convs for m in c.messages if m.token_ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency-ms", default="0,100,500", help="environment latencies, comma-separated")
    ap.add_argument("--overlap", default="1,2,4", help="overlap settings, comma-separated (1: off)")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--conversations", type=int, default=128)
    ap.add_argument("--turns", type=int, default=4, help="policy turns per conversation")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args()
    latencies = [int(x) for x in args.latency_ms.split(",")]
    overlaps = [int(x) for x in args.overlap.split(",")]
    if overlaps[0] != 1:
        ap.error(
            "--overlap: the first setting must be 1 (the run without overlap the others are compared with)"
        )
    torch.set_num_threads(args.threads)
    model, tok = load_tiny(ensure_tiny_model(**MODELS[args.model]))
    engine = HFEngine(model, tok)
    run_once(
        engine, tok, argparse.Namespace(**{**vars(args), "conversations": 4, "turns": 1}), 0.0, 2
    )  # warm-up
    tokens = args.conversations * args.turns * args.max_new_tokens
    results, same = [], True
    for ms in latencies:
        walls: dict[int, list[float]] = {k: [] for k in overlaps}
        engine_s: dict[int, list[float]] = {k: [] for k in overlaps}
        for _ in range(args.repeats):  # interleaved: every setting once per repetition
            seen = {}
            for k in overlaps:
                wall, forward_s, seen[k] = run_once(engine, tok, args, ms / 1000, k)
                walls[k].append(wall)
                engine_s[k].append(forward_s)
            same &= all(seen[k] == seen[1] for k in overlaps)
        row: dict = {"latency_ms": ms}
        for k in overlaps:
            row[f"overlap_{k}_tokens_per_s"] = round(tokens / median(walls[k]), 1)
            # seconds inside the model's forwards over the run: the same rows in k times the calls
            row[f"overlap_{k}_engine_s"] = median(engine_s[k])
        for k in overlaps[1:]:
            row[f"overlap_{k}_speedup"] = round(median(walls[1]) / median(walls[k]), 2)
        results.append(row)
    emit(
        {
            "model": args.model,
            "engine": "HFEngine",
            "conversations": args.conversations,
            "turns": args.turns,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "results": results,
            "same_tokens": same,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
