"""Pieces the rollout benchmarks share: a stop-free policy, a cheap environment, timing, output."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the machine when the benchmark started: `emit` sets the state at the end beside it
_START = (os.getloadavg()[0], time.perf_counter(), os.times())

from interlens_mcore import ChatFormat, Conversation, Environment, MaxTurns, Message, Policy, SamplingParams  # noqa: E402
from interlens_mcore.rollout.conversation import Participant  # noqa: E402


class Feedback(Environment):
    """Answers each policy turn with a short hint (plain Python, no model): a few tokens a turn."""

    name = "env"

    def __init__(self, secret: int, name: str = "env"):
        self.secret, self.name = secret, name

    def respond(self, conv):
        return f"{self.secret} is higher" if conv.turns_taken % 4 == 1 else "lower"


def stop_free_policy(engine, tok, max_new_tokens: int, name: str = "policy") -> Policy:
    """A sampling policy with no stop token, so every turn samples exactly max_new_tokens and
    compared runs do equal work whatever the random model samples."""
    policy = Policy(name, engine, tok, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens))
    policy.chat = StopFreeChat(tok)
    return policy


class StopFreeChat(ChatFormat):
    """The policy's chat format with no stop token (turns end at their token cap)."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return ()


def make_convs(policy: Participant, n: int, turns: int, tag: str = "bench") -> list[Conversation]:
    """n conversations of `turns` policy turns, each answered by the environment."""
    return [
        Conversation(
            [policy, Feedback(i)],
            [Message(speaker="user", content=f"guess the number {i}")],
            run_until=MaxTurns(2 * turns),
            id=f"{tag}{i}",
        )
        for i in range(n)
    ]


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def phase_timer(fn, name: str, phases: list[dict[str, float]]):
    """`fn` wrapped to add its seconds to `phases[-1][name]` (the current step's; nothing before
    the first step): how the TRL comparisons time the trainer's own methods."""

    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if phases:
                phases[-1][name] = phases[-1].get(name, 0.0) + time.perf_counter() - t0

    return wrapped


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def machine_load() -> dict:
    """How loaded the machine was while the benchmark ran, for its JSON line.

    `load_before` / `load_after`: the 1-minute load average at start and now; `cpu_cores_used`:
    this process's CPU seconds (its threads and waited-for children) per wall second; `noisy`:
    other work loaded more than half the cores at either end, so the figures were shared with it.
    The load at the end counts this benchmark's own threads, which `cpu_cores_used` takes off.
    """
    load0, t0, times0 = _START
    load1, times1 = os.getloadavg()[0], os.times()
    wall = max(time.perf_counter() - t0, 1e-9)
    cpu = sum(times1[:4]) - sum(times0[:4])  # user, system, children's user, children's system
    cores = os.cpu_count() or 1
    return {
        "load_before": round(load0, 2),
        "load_after": round(load1, 2),
        "cores": cores,
        "cpu_cores_used": round(cpu / wall, 2),
        "noisy": max(load0, load1 - cpu / wall) > cores / 2,
    }


def emit(out: dict, quiet: bool) -> dict:
    """Print the result: a readable table unless quiet, then one JSON object as the last line,
    with `machine` (see `machine_load`) added."""
    out = {**out, "machine": machine_load()}
    if not quiet:
        for k, v in out.items():
            print(f"{k:>28}: {v}")
    print(json.dumps(out), flush=True)
    return out
