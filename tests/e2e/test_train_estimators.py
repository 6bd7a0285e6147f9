"""`--advantage-estimator` through launch/train_grpo.py: REINFORCE++-baseline trains, and the advantages
it logs share one batch-wide scale (GRPO's would each carry their own group's std)."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest
from support.launch import SMALL, metrics, python, torchrun


def test_reinforce_plus_plus_baseline_runs_with_one_scale_for_the_batch(tmp_path):
    out = tmp_path / "run"
    args = ["--advantage-estimator", "reinforce_plus_plus_baseline", "--steps", "2", "--batch-size", "8"]
    args += ["--num-generations", "4", "--eval-size", "4", "--max-new-tokens", "4", "--output-dir", str(out)]
    args += ["--log-completions-every", "1", "--log-completions", "8"]
    res = python(*args, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1]
    run = json.loads((out / "run.json").read_text())
    assert run["advantage_estimator"] == "reinforce_plus_plus_baseline"
    # A = (r - group mean - batch mean) / batch spread: within a prompt, A_i - A_j = (r_i - r_j) / spread,
    # the same spread for every prompt of the step
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    by_prompt: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for s in samples:
        by_prompt[(s["step"], s["conversation"].split("-")[2])].append(s)
    slopes: dict[int, list[float]] = defaultdict(list)
    for (step, _), group in by_prompt.items():
        for a in group:
            for b in group:
                if a["reward"] - b["reward"] > 1e-3:
                    slopes[step].append((a["advantage"] - b["advantage"]) / (a["reward"] - b["reward"]))
    assert slopes, "no prompt had samples with different rewards"
    for values in slopes.values():
        assert values == pytest.approx([values[0]] * len(values), rel=1e-3)


def test_reinforce_plus_plus_with_dynamic_sampling_on_two_ranks(tmp_path):
    # the batch step runs after the refill, on the final batch, with both ranks in its all-reduces
    out = tmp_path / "run"
    args = ["--advantage-estimator", "reinforce_plus_plus", "--dynamic-sampling", "--max-extra-rounds", "1"]
    args += ["--steps", "2", "--output-dir", str(out), *SMALL]
    res = torchrun(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1] and all(r["samples"] == 16 for r in rows)
    assert all(math.isfinite(r["loss"]) and "dynamic/extra_rounds" in r for r in rows)
