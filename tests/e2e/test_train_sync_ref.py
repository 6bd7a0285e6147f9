"""`--sync-ref-model` (TRL's and ms-swift's option): the KL reference moves toward the policy every
N steps, on both backends, and a resumed run continues from the moved reference."""

from __future__ import annotations

import pytest
from support.launch import SMALL, metrics, torchrun

BACKENDS = {
    "megatron": ["--backend", "megatron"],
    "deepspeed-zero3": ["--backend", "deepspeed", "--zero-stage", "3"],
}


@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=[pytest.mark.slow] if "zero3" in b else []) for b in BACKENDS]
)  # ZeRO-3: the slow stage
def test_a_reference_moved_all_the_way_is_the_policy(tmp_path, backend):
    # alpha 1 after every step: the reference is the policy that generates the next step, so the
    # KL of the next step's single update is 0; without the sync it is not
    args = ["--steps", "3", "--beta", "0.1", "--lr", "0.01", *SMALL, *BACKENDS[backend]]
    synced = torchrun(
        *args,
        "--output-dir",
        str(tmp_path / "a"),
        "--sync-ref-model",
        "--ref-model-sync-steps",
        "1",
        "--ref-model-mixup-alpha",
        "1.0",
    )
    assert synced.returncode == 0, synced.stderr[-3000:]
    plain = torchrun(*args, "--output-dir", str(tmp_path / "b"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    kl_synced = [r["kl"] for r in metrics(tmp_path / "a")]
    kl_plain = [r["kl"] for r in metrics(tmp_path / "b")]
    assert kl_synced[0] == kl_plain[0] == 0.0  # step 0: the reference is the initial policy in both
    assert all(abs(k) < 1e-7 for k in kl_synced[1:]), kl_synced
    assert all(k > 1e-6 for k in kl_plain[1:]), kl_plain


@pytest.mark.slow  # not a first path: the slow stage (README, Set-up)
def test_a_resumed_run_keeps_the_moved_reference(tmp_path):
    args = ["--beta", "0.1", "--lr", "0.01", *SMALL, "--sync-ref-model", "--ref-model-sync-steps", "1"]
    args += ["--ref-model-mixup-alpha", "0.5", "--eval-every", "0"]
    whole = torchrun(*args, "--steps", "4", "--output-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = torchrun(*args, "--steps", "2", "--output-dir", str(tmp_path / "cut"))  # saves at step 2
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "cut" / "checkpoints" / "step-000002" / "reference").is_dir()
    rest = torchrun(*args, "--steps", "4", "--resume", "--output-dir", str(tmp_path / "cut"))
    assert rest.returncode == 0, rest.stderr[-3000:]
    kl_whole = [r["kl"] for r in metrics(tmp_path / "whole")]
    kl_cut = [r["kl"] for r in metrics(tmp_path / "cut")]
    # the KL to the reference after the resume is the uninterrupted run's: the moved reference
    # came back from the checkpoint (the initial weights would give another KL)
    assert kl_cut == pytest.approx(kl_whole, rel=1e-4, abs=1e-9)
