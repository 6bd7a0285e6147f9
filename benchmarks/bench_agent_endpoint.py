"""Agents through the OpenAI-compatible endpoint versus the same conversations through co_step.

    python benchmarks/bench_agent_endpoint.py --json
    python benchmarks/bench_agent_endpoint.py --agents 8 --turns 2 --repeats 1 --json

What is compared, on ONE engine object (HFEngine on the tiny model, or `--model qwen2-12m`):

- "endpoint": `run_agents_async` (the `--agent` rollout path) plays N agents in lockstep rounds
  (`AgentRounds`) against the aiohttp `AgentEndpoint`. Each agent is written with the real
  `openai.AsyncOpenAI` client, as agents are: it sends its whole history with every call, reads
  the reply's text, appends the reply and the environment's answer, and calls again, --turns
  times. Each call asks for `max_tokens=--max-new-tokens` with vLLM's `ignore_eos` (through
  `extra_body`), so no reply stops early at the template's end of turn.
- "co_step": the same N conversations (the same opening message, the same `Feedback`
  environment from common.py, --turns policy turns) through `co_step` with a policy whose chat
  format has no stop token (`StopFreeChat`), so each turn samples exactly --max-new-tokens.

Both paths therefore sample the same number of tokens per turn from prompts of the same
lengths (checked: `same_sampled_tokens`, `same_prompt_tokens`), and both batch every live
conversation's turn into one engine call per round (`engine_calls_*`, counted by a wrapper
around the shared engine: aim equal). The endpoint's extra time is what it costs to serve the
agents: HTTP on localhost, JSON both ways, the client's request and response objects, the
session's history matching and rendering, asyncio. `ratio` is the endpoint's tokens per second
over co_step's (aim >= 0.8). `client_setup_s`, measured apart after each endpoint run, is what
building the run's N clients as `run_agents_async` builds them costs alone (each `AsyncOpenAI`
loads the system's certificate store for TLS, which an http:// endpoint never uses).
Repetitions alternate endpoint / co_step; the 1-minute load average is recorded before and
after each. With --profile, one more endpoint run goes under cProfile and the top functions
by cumulative and by own time are printed (not in the JSON).
Prints one JSON object as the last line (medians, then every repetition in "repetitions").
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import time
from types import SimpleNamespace
from typing import Any

import torch
from bench_engines import MODELS
from common import Feedback, emit, make_convs, median, stop_free_policy, timed

from interlens_mcore import HFEngine, SamplingParams, co_step
from interlens_mcore.agents.task import run_agents_async
from interlens_mcore.assets import ensure_tiny_model, load_tiny
from interlens_mcore.rollout.rollouter import RolloutPlan, Sample
from interlens_mcore.rollout.vote import local_gather


class Counting:
    """The shared engine, counted: generate calls, rows, prompt and sampled tokens."""

    def __init__(self, engine: HFEngine):
        self.engine, self.name, self.max_context = engine, engine.name, engine.max_context
        self.stats = engine.stats
        self.reset()

    def reset(self) -> None:
        self.calls, self.rows, self.prompt_tokens, self.sampled_tokens = 0, 0, 0, 0
        self.stats.reset()

    def generate(self, requests):
        self.calls += 1
        self.rows += len(requests)
        self.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        out = self.engine.generate(requests)
        self.sampled_tokens += sum(len(g.token_ids) for g in out)
        return out


def guesser(turns: int, max_new_tokens: int):
    """An agent as one is written against the OpenAI API: it re-sends its history every call."""

    async def agent(client, row: int) -> float:
        env = Feedback(row)
        history = [{"role": "user", "content": f"guess the number {row}"}]
        for t in range(turns):
            reply = await client.chat.completions.create(
                model="policy",
                messages=history,
                max_tokens=max_new_tokens,
                extra_body={"ignore_eos": True},
            )
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
            # Feedback reads only the turns taken: after policy turn t that is 2t + 1, as in co_step
            history.append({"role": "user", "content": env.respond(SimpleNamespace(turns_taken=2 * t + 1))})
        return 0.0

    return agent


def endpoint_run(engine: Counting, tok, n: int, turns: int, max_new: int) -> float:
    samples = [Sample(row=i, group=i, generation=0, index=i, id=f"agent{i}", seed=i) for i in range(n)]
    plan = RolloutPlan(
        samples=samples,
        group_seed=0,
        engine=engine,
        tokenizer=tok,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new),
        gather_fn=local_gather,
        rank=0,
        step_timeout_s=None,
    )
    t0 = time.perf_counter()
    trajectories, _, rounds = asyncio.run(run_agents_async(plan, guesser(turns, max_new)))
    wall = time.perf_counter() - t0
    calls = [t.infos.extra["agent_calls"] for t in trajectories]
    if calls != [turns] * n:
        raise RuntimeError(f"bench_agent_endpoint: agents made {calls} calls, expected {turns} each")
    if rounds.engine_calls != engine.calls:
        raise RuntimeError(f"rounds counted {rounds.engine_calls} engine calls, the engine {engine.calls}")
    return wall


def co_step_run(engine: Counting, tok, n: int, turns: int, max_new: int) -> float:
    convs = make_convs(stop_free_policy(engine, tok, max_new), n, turns)
    wall, _ = timed(co_step, convs, turns=None)
    return wall


RUNS = {"endpoint": endpoint_run, "co_step": co_step_run}


def client_setup(n: int) -> float:
    """Seconds to build n `AsyncOpenAI` clients as `run_agents_async` builds them, alone."""
    import openai

    async def build() -> float:
        t0 = time.perf_counter()
        clients = [
            openai.AsyncOpenAI(
                base_url="http://127.0.0.1:1/v1", api_key="interlens", max_retries=0, timeout=None
            )
            for _ in range(n)
        ]
        wall = time.perf_counter() - t0
        await asyncio.gather(*(c.close() for c in clients))
        return wall

    return asyncio.run(build())


def once(path: str, engine: Counting, tok, args) -> dict:
    engine.reset()
    load_before = os.getloadavg()[0]
    wall = RUNS[path](engine, tok, args.agents, args.turns, args.max_new_tokens)
    return {
        "path": path,
        "wall_s": round(wall, 4),
        "tokens_per_s": round(engine.sampled_tokens / wall, 1),
        "sampled_tokens": engine.sampled_tokens,
        "prompt_tokens": engine.prompt_tokens,
        "engine_calls": engine.calls,
        "engine_rows": engine.rows,
        "engine_time_fraction": round(engine.stats.forward_s / wall, 3),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        **({"client_setup_s": round(client_setup(args.agents), 4)} if path == "endpoint" else {}),
    }


def profile(engine: Counting, tok, args, top: int = 25) -> str:
    """One endpoint run under cProfile: the top functions by cumulative and by own time."""
    engine.reset()
    prof = cProfile.Profile()
    prof.enable()
    endpoint_run(engine, tok, args.agents, args.turns, args.max_new_tokens)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs()
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--agents", type=int, default=64, help="agents (and conversations) per run")
    ap.add_argument("--turns", type=int, default=4, help="calls per agent (policy turns per conversation)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each path, interleaved")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one more endpoint run")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    for name in ("agents", "turns", "max_new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    overrides: dict[str, Any] = MODELS[args.model]
    model, tok = load_tiny(ensure_tiny_model(**overrides) if overrides else None)
    engine = Counting(HFEngine(model, tok))
    for path in RUNS:  # warm-up at full size: imports, the allocator's growth, the first connections
        once(path, engine, tok, args)
    reps = [once(path, engine, tok, args) for _ in range(args.repeats) for path in RUNS]
    by = {path: [r for r in reps if r["path"] == path] for path in RUNS}
    out: dict = {
        "model": args.model,
        "agents": args.agents,
        "turns": args.turns,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
    }
    for path, rows in by.items():
        out[f"{path}_s"] = median([r["wall_s"] for r in rows])
        out[f"{path}_tokens_per_s"] = round(median([r["tokens_per_s"] for r in rows]), 1)
        out[f"{path}_engine_time_fraction"] = median([r["engine_time_fraction"] for r in rows])
        out[f"engine_calls_{path}"] = rows[0]["engine_calls"]
        out[f"sampled_tokens_{path}"] = rows[0]["sampled_tokens"]
    out["client_setup_s"] = median([r["client_setup_s"] for r in by["endpoint"]])
    out["ratio"] = round(out["endpoint_tokens_per_s"] / out["co_step_tokens_per_s"], 3)
    out["same_engine_calls"] = len({r["engine_calls"] for r in reps}) == 1
    out["same_sampled_tokens"] = len({r["sampled_tokens"] for r in reps}) == 1
    out["same_prompt_tokens"] = len({r["prompt_tokens"] for r in reps}) == 1
    loads = [x for r in reps for x in (r["load_before"], r["load_after"])]
    out["load_max"] = max(loads)
    out["repetitions"] = reps
    if args.profile:
        print(profile(engine, tok, args))
    if not args.json:  # the repetitions one a line, then the medians (emit)
        for r in reps:
            load = f"load {r['load_before']}-{r['load_after']}"
            print(f"{r['path']:>9}: {r['wall_s']:8.3f} s {r['tokens_per_s']:9.1f} tok/s, {load}")
    return emit(out, args.json)


if __name__ == "__main__":
    main()
