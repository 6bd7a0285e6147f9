"""Short end-to-end runs of launch/train_grpo.py on 2 gloo ranks, both backends."""

from __future__ import annotations

import math

import pytest
from support.launch import SMALL, metrics, torchrun

KEYS = {"step", "reward_mean", "reward_std", "loss", "kl", "is/sample_fraction", "is/weight_mean", "tokens"}
KEYS |= {"rollout_s", "train_s", "entropy"}


def _check_run(out, steps: int) -> list[dict]:
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert math.isfinite(r["loss"]) and r["tokens"] > 0
        # the policy's mean entropy over the loss tokens, in nats: every backend and layout logs it
        assert 0.0 < r["entropy"] < math.log(200_000)
        # every sample's rollout logprobs are complete, so IS correction covers all of them
        assert r["is/sample_fraction"] == 1.0
    assert (out / "reward.png").stat().st_size > 0
    assert (out / "completions.jsonl").is_file() and (out / "run.json").is_file()
    assert (out / "checkpoints" / f"step-{steps:06d}" / "meta.json").is_file()
    return rows


def test_megatron_dp2_micro_batches(tmp_path):
    out = tmp_path / "run"
    res = torchrun("--output-dir", str(out), "--steps", "3", "--micro-batch-size", "3", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _check_run(out, 3)
    # the model on rank 0 generates with its updated weights: train and rollout policies agree
    assert all(r["is/weight_mean"] == pytest.approx(1.0, abs=1e-3) for r in rows)
    # the progress bar says when the held-out rows are played (SMALL: 4 a rank), before and after
    assert res.stderr.count("evaluating 8 held-out rows") >= 2, res.stderr[-3000:]


def test_megatron_bf16_autocast(tmp_path):
    """--bf16: forwards and backward under bfloat16 autocast; the engine and the trainer agree."""
    out = tmp_path / "run"
    res = torchrun("--output-dir", str(out), "--steps", "2", "--bf16", "true", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _check_run(out, 2)
    # both forwards round the same way, so rollout and training logprobs agree closely
    assert all(r["is/weight_mean"] == pytest.approx(1.0, abs=0.02) for r in rows)
    assert rows[-1]["grad_norm"] > 0


def test_megatron_tp2_exports_and_resumes_at_tp1(tmp_path, tiny_path):
    import torch
    from transformers import AutoModelForCausalLM

    out, hf = tmp_path / "run", tmp_path / "hf"
    res = torchrun("--output-dir", str(out), "--steps", "2", "--tp", "2", "--export-hf", str(hf), *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    _check_run(out, 2)
    # the exported folder loads through from_pretrained and holds the trained (changed) weights
    trained = AutoModelForCausalLM.from_pretrained(hf)
    start = AutoModelForCausalLM.from_pretrained(tiny_path)
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(trained.state_dict()[name], start.state_dict()[name])
    assert torch.isfinite(trained(torch.tensor([[1, 2, 3]])).logits).all()
    # sharded checkpoints reshard: saved by two TP=2 shards, loaded whole by TP=1 ranks
    res = torchrun("--output-dir", str(out), "--steps", "3", "--tp", "1", *SMALL, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming at step 2 of 3" in res.stderr
    assert [r["step"] for r in metrics(out)] == [0, 1, 2]


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed(tmp_path, stage):
    out = tmp_path / "run"
    res = torchrun(
        "--output-dir", str(out), "--steps", "2", "--backend", "deepspeed", "--zero-stage", str(stage), *SMALL
    )
    assert res.returncode == 0, res.stderr[-3000:]
    _check_run(out, 2)
