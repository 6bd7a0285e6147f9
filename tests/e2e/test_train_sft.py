"""`--sft-data`: the supervised warm-up before GRPO, through train_grpo.py under torchrun.

Launched because the phase runs in the training backends, whose parallel layouts (ZeRO over two
DP ranks; Megatron TP=2 with LoRA adapters) exist only in a two-process launch. Parsing, the
mask and the demonstrations are unit-tested in tests/unit/trainers/test_sft.py.
"""

from __future__ import annotations

import json

from support.launch import SMALL, metrics, torchrun

from interlens_mcore.tasks.toy import GuessTasks


def demos(tmp_path):
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in GuessTasks().demonstrations(64, seed=0)))
    return str(path)


def sft_records(out):
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines() if s.strip()]
    return [r for r in lines if "sft_step" in r]


def test_deepspeed_warm_up_resumes_where_it_was_cut(tmp_path):
    out = tmp_path / "run"
    args = [*SMALL, "--backend", "deepspeed", "--zero-stage", "2", "--eval-every", "0", "--beta", "0.1"]
    args += ["--sft-data", demos(tmp_path), "--sft-lr", "0.001", "--output-dir", str(out)]
    cut = torchrun(*args, "--sft-steps", "3", "--steps", "0")  # the phase alone, saved after 3 steps
    assert cut.returncode == 0, cut.stderr[-3000:]
    rest = torchrun(*args, "--sft-steps", "6", "--steps", "1", "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    records = sft_records(out)
    # the resumed run continued the phase at step 3 (nothing redone), then trained one GRPO step
    assert [r["sft_step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert all(r["sft/tokens"] > 0 for r in records)
    losses = [r["sft/loss"] for r in records]
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    assert [r["step"] for r in metrics(out)] == [0]
    state = json.loads((out / "checkpoints" / "step-000001" / "trainer-rank00000.json").read_text())
    assert state["sft_step"] == 6  # a run cut from here on does not redo the phase


def test_megatron_tp2_lora_warm_up_lowers_the_loss(tmp_path):
    out = tmp_path / "run"
    args = [*SMALL, "--backend", "megatron", "--tp", "2", "--lora-rank", "8", "--eval-every", "0"]
    args += ["--sft-data", demos(tmp_path), "--sft-lr", "0.003", "--sft-steps", "6", "--steps", "1"]
    run = torchrun(*args, "--output-dir", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [r["sft/loss"] for r in sft_records(out)]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert "sft step 5: loss" in run.stderr  # the progress bar showed the phase
