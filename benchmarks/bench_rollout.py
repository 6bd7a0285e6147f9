"""Rollout throughput: co_step batched versus the same engine one conversation at a time,
versus the loop a user would write with transformers `generate` per conversation.

    python benchmarks/bench_rollout.py --json
    python benchmarks/bench_rollout.py --conversations 8,32,128 --json

N conversations x 4 policy turns against an environment participant, on the tiny model.
One-at-a-time runs are independent of N, so for N > --sequential-sample they run on the first
--sequential-sample conversations and are compared by tokens per second.
`engine_calls_mixed_envs` counts the engine calls of 12 conversations that each face their own
environment, `engine_calls_one_env` those of 12 that share one: batching is by the speaking
policy, so the two are equal.
Prints one JSON object as the last line (with several N: the largest N's keys, plus "runs").
"""

from __future__ import annotations

import argparse
import time

import torch
from common import Feedback, emit, make_convs, stop_free_policy, timed

from interlens_mcore import Conversation, HFEngine, MaxTurns, Message, co_step
from interlens_mcore.assets import load_tiny


def run(engine: HFEngine, policy, n: int, turns: int, batched: bool) -> tuple[float, int]:
    convs = make_convs(policy, n, turns)
    engine.stats.reset()
    if batched:
        wall, _ = timed(co_step, convs, turns=None)
    else:
        wall, _ = timed(lambda: [co_step([c], turns=None) for c in convs])
    return wall, engine.stats.generated_tokens


@torch.inference_mode()
def hf_generate_loop(model, tok, n: int, turns: int, max_new: int) -> tuple[float, int]:
    """What a user writes with transformers alone: re-template the history, `generate`, repeat."""
    t0, tokens = time.perf_counter(), 0
    for i in range(n):
        env, messages = Feedback(i), [{"role": "user", "content": f"guess the number {i}"}]
        for t in range(turns):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            out = model.generate(
                ids,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=True,
                pad_token_id=tok.pad_token_id,
            )
            tokens += out.shape[1] - ids.shape[1]
            reply = env.respond(_Turns(2 * t + 1))
            messages += [{"role": "assistant", "content": tok.decode(out[0, ids.shape[1] :])}]
            messages += [{"role": "user", "content": reply}]
    return time.perf_counter() - t0, tokens


class _Turns:
    """Stands in for a Conversation where Feedback only reads `turns_taken`."""

    def __init__(self, turns_taken: int):
        self.turns_taken = turns_taken


class _Counting:
    """Counts generate calls of the engine it wraps."""

    def __init__(self, engine: HFEngine):
        self.engine, self.name, self.max_context, self.calls = engine, engine.name, engine.max_context, 0

    def generate(self, requests):
        self.calls += 1
        return self.engine.generate(requests)


class _Named(Feedback):
    def __init__(self, secret: int, name: str):
        super().__init__(secret)
        self.name = name


def engine_calls(model, tok, n: int, turns: int, distinct_envs: bool) -> int:
    """Engine calls of n conversations, each with its own environment name or all with one."""
    engine = _Counting(HFEngine(model, tok))
    policy = stop_free_policy(engine, tok, 4)
    convs = [
        Conversation(
            [policy, _Named(i, f"env{i}") if distinct_envs else Feedback(i)],
            [Message(speaker="user", content=f"guess the number {i}")],
            run_until=MaxTurns(2 * turns),
            id=f"calls{i}",
        )
        for i in range(n)
    ]
    co_step(convs, turns=None)
    return engine.calls


def measure(model, tok, n: int, args) -> dict:
    engine = HFEngine(model, tok)
    policy = stop_free_policy(engine, tok, args.max_new_tokens)
    b_wall, b_tokens = run(engine, policy, n, args.turns, batched=True)
    b_forward = engine.stats.forward_s
    few = min(n, args.sequential_sample)
    s_wall, s_tokens = run(engine, policy, few, args.turns, batched=False)
    h_wall, h_tokens = hf_generate_loop(model, tok, few, args.turns, args.max_new_tokens)
    rate = {"b": b_tokens / b_wall, "s": s_tokens / s_wall, "h": h_tokens / h_wall}
    return {
        "conversations": n,
        "turns": args.turns,
        "max_new_tokens": args.max_new_tokens,
        "sequential_conversations_run": few,
        "batched_tokens": b_tokens,
        "sequential_tokens": s_tokens,
        "batched_s": round(b_wall, 3),
        "sequential_s": round(s_wall, 3),
        "hf_generate_s": round(h_wall, 3),
        "batched_tokens_per_s": round(rate["b"], 1),
        "sequential_tokens_per_s": round(rate["s"], 1),
        "hf_generate_tokens_per_s": round(rate["h"], 1),
        "speedup": round(rate["b"] / rate["s"], 2),
        "speedup_vs_hf_generate": round(rate["b"] / rate["h"], 2),
        "engine_time_fraction": round(b_forward / b_wall, 3),
        "engine_calls_mixed_envs": engine_calls(model, tok, 12, args.turns, distinct_envs=True),
        "engine_calls_one_env": engine_calls(model, tok, 12, args.turns, distinct_envs=False),
        "threads": args.threads,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", default="64", help="one number or a comma-separated list")
    ap.add_argument("--turns", type=int, default=4, help="policy turns per conversation")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--sequential-sample", type=int, default=16, help="most conversations run one at a time")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_tiny()
    warm = HFEngine(model, tok)
    run(warm, stop_free_policy(warm, tok, 4), 4, 1, batched=True)  # warm-up
    runs = [measure(model, tok, int(n), args) for n in args.conversations.split(",")]
    out = dict(runs[-1])
    if len(runs) > 1:
        out["runs"] = runs
    return emit(out, args.json)


if __name__ == "__main__":
    main()
