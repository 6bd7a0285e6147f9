"""Each task family's own defaults give a first step something to learn from.

GRPO learns nothing from a group whose samples all score alike. With nothing but `--task`
(and, for reasoning-gym, questions sized for the model), one round of `launch/rollout.py` on
each family's defaults (SmolLM2-135M-Instruct, 8 generations at temperature 0.7, the family's
reply length) must give at least one group of samples with different rewards.

The reasoning-gym case keeps launch/configs/smollm2_basic_arithmetic.yaml's task arguments
(two one- or two-digit terms, the last number as the answer): on reasoning-gym's default
basic_arithmetic (negations, parentheses, up to six terms) the 135M model scored 0 in all 32
samples of two rounds here, and the run's health check then warns that no group varies.

Slow (SmolLM2 on CPU, about a minute per family on an idle 2-core machine), so marked `slow`:
`.ci/run` runs these in a stage of their own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest
from support.launch import ROOT, env

pytestmark = pytest.mark.slow

EASY_SUMS = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 2,
    "operators": ["+", "-"],
    "allow_parentheses": False,
    "allow_negation": False,
    "answer_fallback": "last_number",
}
FAMILIES = {
    "reasoning_gym": ["--task", "reasoning_gym:basic_arithmetic", "--task-args", json.dumps(EASY_SUMS)],
    "gym": ["--task", "gym:Blackjack-v1"],
    "textarena": ["--task", "textarena:TicTacToe-v0"],
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_family_defaults_give_a_group_with_reward_variance(family, tmp_path):
    out = tmp_path / "look"
    cmd = [sys.executable, str(ROOT / "launch" / "rollout.py"), *FAMILIES[family], "--output-dir", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env(), cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    said = next(line for line in res.stderr.splitlines() if line.startswith("options: "))
    assert "--model smollm2 (task " in said and "--num-generations 8 (task " in said, said
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        groups[r["group"], r["seat"]].append(r["reward"])
    assert all(len(g) == 8 for g in groups.values()), {k: len(g) for k, g in groups.items()}
    varied = [k for k, g in groups.items() if len(set(g)) > 1]
    assert varied, f"{family}: every group scored alike: {dict(groups)}"
