"""launch/train_grpo.py as a TRL user drives it: TRL names, a warmup schedule, gradient
accumulation, then --eval-only on the checkpoint the run wrote (2 gloo ranks)."""

from __future__ import annotations

import json

import pytest
from support.launch import all_records, metrics, torchrun

# SMALL with TRL's names where they have one
TRL = ["--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "4"]
TRL += ["--save_steps", "2", "--eval-size", "4", "--eval_steps", "0"]


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_warmup_raises_lr_with_accumulated_micro_batches(tmp_path, backend):
    out = tmp_path / "run"
    res = torchrun(
        "--output-dir", str(out), "--max_steps", "3", "--batch-size", "8", "--backend", backend,
        "--learning_rate", "3e-3", "--warmup_steps", "3", "--lr_scheduler_type", "linear",
        *TRL, timeout=420,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # warmup over 3 steps: lr/3, 2lr/3, lr; every step trained (8 trajectories, micro-batches of 4)
    assert [r["learning_rate"] for r in rows] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert all(r["tokens"] > 0 and r["grad_norm"] > 0 for r in rows)
    run = json.loads((out / "run.json").read_text())
    assert (run["lr"], run["micro_batch_size"], run["warmup_steps"]) == (3e-3, 4, 3)


def test_eval_only_evaluates_the_checkpoint_and_writes_nothing_else(tmp_path):
    out = tmp_path / "run"
    common = ["--output-dir", str(out), "--batch-size", "8", "--learning_rate", "3e-3", *TRL]
    res = torchrun(*common, "--max_steps", "2", timeout=420)
    assert res.returncode == 0, res.stderr[-3000:]
    before = sorted(p.relative_to(out) for p in (out / "checkpoints").iterdir())
    lines = (out / "metrics.jsonl").read_text()
    # the run's options, with more held-out rows than its own evaluations played
    res = torchrun(*common, "--max_steps", "2", "--resume", "--eval-only", "--eval-size", "6", timeout=420)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["step"] == 2 and summary["eval/success_n"] == 12  # 6 rows per rank, 2 ranks
    assert "eval/reward" in summary and "eval-only at step 2" in res.stderr
    assert json.loads((out / "eval.jsonl").read_text()) == summary
    # no training, no checkpoint, the run's own log untouched
    assert sorted(p.relative_to(out) for p in (out / "checkpoints").iterdir()) == before
    assert (out / "metrics.jsonl").read_text() == lines and len(all_records(out)) == 2


def test_eval_only_of_a_model_folder(tmp_path, tiny_path):
    res = torchrun("--model", str(tiny_path), "--eval-only", "--eval-size", "2", "--max-new-tokens", "4",
                   "--batch-size", "4", "--num-generations", "4", timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["step"] == 0 and summary["eval/success_n"] == 4
