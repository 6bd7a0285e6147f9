"""Turns: key/value reuse across turns versus re-encoding the history, per engine family.

    python benchmarks/bench_turns.py --turns 2,4,8,16 --json
    python benchmarks/bench_turns.py --engine megatron --json

`--engine hf`: PrefixCachingEngine against HFEngine (what a driver that re-templates the history
gets). `--engine megatron`: MegatronEngine keeping prefixes (its default) against the same engine
with `prefix_bytes=0`. Both engines of a pair generate the same tokens (checked on every run); the
re-encoding one prefills the whole conversation every turn, the reusing one only what was
appended since its last turn. Repetitions alternate the two; medians of --repeats.

`seat_reuse`: the reusing engine's share of prompt tokens taken from its cache (reused / (reused +
prefilled)) on the same conversations played by one policy seat ([policy, env]) and by two seats
of that engine ([seat_a, env_a, seat_b, env_b], self-play), each seat taking --seat-turns turns;
`two_seats_same_length` gives each seat half of them, a conversation as long as one seat's. A seat
must prefill what the other seat said (it never fed those tokens from its own side), so two seats
reuse less than one at the same length even when no entry is lost.

Prints one JSON object as the last line, with the machine's load before and after.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import Feedback, emit, make_convs, median, stop_free_policy, timed

from interlens_mcore import Conversation, HFEngine, MaxTurns, Message, co_step
from interlens_mcore.assets import ensure_tiny_model, load_tiny
from interlens_mcore.assets.smollm2 import ensure_smollm2
from interlens_mcore.engines.prefix_cache import PrefixCachingEngine


def run_once(engine, tok, n: int, turns: int, max_new: int) -> tuple[float, list]:
    if hasattr(engine, "clear"):
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


def reuse_share(engine, tok, n: int, seats: int, turns_per_seat: int, max_new: int) -> float:
    """The share of prompt tokens `engine` took from its cache over n conversations of `seats`
    policy seats (one engine), each answered by an environment, each taking `turns_per_seat`."""
    engine.clear()
    engine.reuse.reset()
    policies = [stop_free_policy(engine, tok, max_new, name=f"seat{s}") for s in range(seats)]
    convs = [
        Conversation(
            [q for s, p in enumerate(policies) for q in (p, Feedback(i, name=f"env{s}"))],
            [Message(speaker="user", content=f"guess the number {i}")],
            run_until=MaxTurns(2 * seats * turns_per_seat),
            id=f"seats{i}",
        )
        for i in range(n)
    ]
    co_step(convs, turns=None)
    stats = engine.reuse
    return round(stats.reused_tokens / max(stats.reused_tokens + stats.prefill_tokens, 1), 3)


def seat_reuse(engine, tok, n: int, turns_per_seat: int, max_new: int) -> dict:
    return {
        "turns_per_seat": turns_per_seat,
        "one_seat": reuse_share(engine, tok, n, 1, turns_per_seat, max_new),
        "two_seats": reuse_share(engine, tok, n, 2, turns_per_seat, max_new),
        "two_seats_same_length": reuse_share(engine, tok, n, 2, max(turns_per_seat // 2, 1), max_new),
    }


def megatron_engines(path, tok) -> dict:
    """MegatronEngine on the tiny model in a one-rank world: keeping prefixes and not."""
    from megatron.core import parallel_state

    from interlens_mcore import distributed
    from interlens_mcore.megatron import MegatronEngine, build_model, load_hf_weights, load_layout

    distributed.init_distributed()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    layout = load_layout(path)
    model = build_model(layout, init_weights=False)
    load_hf_weights(model, layout, path)
    return {
        "reencode": MegatronEngine(model, layout, tokenizer=tok, prefix_bytes=0),
        "reuse": MegatronEngine(model, layout, tokenizer=tok),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", default="2,4,8,16", help="comma-separated policy turns per conversation")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seat-turns", type=int, default=8, help="turns a seat takes in seat_reuse")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", choices=("hf", "megatron"), default="hf", help="which engine family")
    ap.add_argument("--model", default="tiny", help="tiny, smollm2, or a local Hugging Face folder")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model == "tiny":
        path = ensure_tiny_model()
    elif args.model == "smollm2":
        path = ensure_smollm2()
    else:
        path = Path(args.model)
    model, tok = load_tiny(path)
    if args.engine == "hf":
        engines = {"reencode": HFEngine(model, tok), "reuse": PrefixCachingEngine(model, tok)}
    else:
        engines = megatron_engines(path, tok)
    run_once(engines["reuse"], tok, 4, 1, 4)  # warm-up
    rows = [
        measure(engines, tok, args.conversations, int(t), args.max_new_tokens, args.repeats)
        for t in args.turns.split(",")
    ]
    out = {
        "engine": args.engine,
        "model": args.model,
        "conversations": args.conversations,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "runs": rows,
        "speedup_at_8_turns": next((r["speedup"] for r in rows if r["turns"] == 8), None),
        "same_tokens": all(r["same_tokens"] for r in rows),
        "seat_reuse": seat_reuse(
            engines["reuse"], tok, args.conversations, args.seat_turns, args.max_new_tokens
        ),
    }
    return emit(out, args.json)


if __name__ == "__main__":
    main()
