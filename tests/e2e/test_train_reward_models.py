"""A reward model folder and a generative judge each train 3 steps from the command line:

torchrun --nproc_per_node=2 launch/train_grpo.py --reward-model RM_FOLDER --steps 3
torchrun --nproc_per_node=2 launch/train_grpo.py --judge-model FOLDER --judge-template judge.txt
"""

from __future__ import annotations

import json

import pytest
from support.launch import SMALL, metrics, torchrun


def test_reward_model_trains_three_steps(tmp_path):
    from interlens_mcore.assets import ensure_tiny_classifier

    out = tmp_path / "out"
    args = ["--reward-model", str(ensure_tiny_classifier()), "--reward-model-batch-size", "3"]
    args += ["--reward-weights", "1.0", "2.0", "--steps", "3", "--output-dir", str(out)]
    res = torchrun(*args, *SMALL, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["reward/reward_model"] != 0.0  # the classifier's scores of this step's samples
        assert r["reward_mean"] == pytest.approx(r["reward/env"] + 2.0 * r["reward/reward_model"], abs=1e-5)
    run = json.loads((out / "run.json").read_text())
    assert run["rewards"] == ["env", "reward_model"] and run["reward_weights"] == [1.0, 2.0]


def test_judge_trains_three_steps(tmp_path, tiny_path):
    template = tmp_path / "judge.txt"
    template.write_text("Is this a good guess?\n{prompt}\nGuess: {completion}\nscore:")
    out = tmp_path / "out"
    args = ["--judge-model", str(tiny_path), "--judge-template", str(template), "--judge-max-new-tokens", "4"]
    args += ["--steps", "3", "--output-dir", str(out)]
    res = torchrun(*args, *SMALL, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    samples = 2 * 8  # two ranks, --batch-size 8
    for r in rows:
        assert 0.0 <= r["reward/judge"] <= 1.0
        assert 0 <= r["judge/unparsed"] <= samples
        assert r["reward_mean"] == pytest.approx(r["reward/env"] + r["reward/judge"], abs=1e-5)
    assert json.loads((out / "run.json").read_text())["rewards"] == ["env", "judge"]
