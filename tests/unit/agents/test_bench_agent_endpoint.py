"""The agent endpoint benchmark at a tiny size: its JSON line, and both paths doing equal work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # not a first path: the slow stage (README, Set-up)
def test_bench_agent_endpoint_smoke():
    # 3 agents x 2 calls x 3 tokens: each path samples 3 * 2 * 3 = 18 tokens in 2 engine calls
    # (one per round), whatever the random model samples, since no reply may stop early
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_agent_endpoint.py"),
        *("--agents", "3", "--turns", "2", "--max-new-tokens", "3", "--repeats", "2", "--threads", "1"),
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("endpoint_tokens_per_s", "co_step_tokens_per_s", "ratio", "client_setup_s", "load_max"):
        assert isinstance(out[key], (int, float)) and out[key] >= 0, key
    assert out["engine_calls_endpoint"] == out["engine_calls_co_step"] == 2
    assert out["sampled_tokens_endpoint"] == out["sampled_tokens_co_step"] == 18
    assert out["same_engine_calls"] and out["same_sampled_tokens"] and out["same_prompt_tokens"]
    reps = out["repetitions"]
    assert [r["path"] for r in reps] == ["endpoint", "co_step"] * 2  # interleaved
    assert all(r["engine_rows"] == 6 and r["load_before"] >= 0 and r["load_after"] >= 0 for r in reps)
