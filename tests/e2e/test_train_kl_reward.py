"""`--kl-in-reward` (verl's use_kl_in_reward, ms-swift's kl_in_reward) under torchrun: the adaptive
coefficient follows verl's controller from the logged KL on both backends and under TP, and a
resumed run goes on with the adapted coefficient."""

from __future__ import annotations

import pytest
from support.launch import SMALL, metrics, torchrun

TARGET, HORIZON, WORLD_SAMPLES = 0.01, 100, 16  # SMALL: 8 samples on each of 2 ranks
ADAPTIVE = [
    "--kl-in-reward",
    "--kl-ctrl",
    "adaptive",
    "--kl-target",
    str(TARGET),
    "--kl-horizon",
    str(HORIZON),
]
SETUPS = {  # megatron at TP=1: the resumed-run test's uninterrupted run
    "megatron-tp2": ["--backend", "megatron", "--tp", "2"],
    "deepspeed-zero3": ["--backend", "deepspeed", "--zero-stage", "3"],
}


def next_coef(coef: float, kl: float) -> float:
    error = min(max(kl / TARGET - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * WORLD_SAMPLES / HORIZON)


def _follows_the_controller(rows: list[dict]) -> None:
    kl = [r["kl_in_reward/kl"] for r in rows]
    coef = [r["kl_in_reward/coef"] for r in rows]
    assert kl[0] == pytest.approx(0.0, abs=1e-7)  # step 0: the reference is the policy
    assert all(k > 1e-6 for k in kl[1:]), kl  # then the policy has moved
    assert coef[0] == 0.1
    for i in range(1, len(coef)):
        assert coef[i] == pytest.approx(next_coef(coef[i - 1], kl[i - 1]), rel=1e-9), (i, kl, coef)
    # the loss has no KL term: the KL is in the reward only
    assert all(r.get("kl", 0.0) == 0.0 for r in rows), [r.get("kl") for r in rows]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_coefficient_follows_the_logged_kl(tmp_path, setup):
    args = ["--steps", "3", "--beta", "0.1", "--lr", "0.01", "--eval-every", "0", *ADAPTIVE, *SMALL]
    res = torchrun(*args, *SETUPS[setup], "--output-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    _follows_the_controller(metrics(tmp_path))


@pytest.mark.slow  # not a first path: the slow stage (README, Set-up)
def test_a_resumed_run_goes_on_with_the_adapted_coefficient(tmp_path):
    args = ["--beta", "0.1", "--lr", "0.01", "--eval-every", "0", *ADAPTIVE, *SMALL]
    whole = torchrun(*args, "--steps", "4", "--output-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    _follows_the_controller(metrics(tmp_path / "whole"))  # megatron at TP=1
    first = torchrun(*args, "--steps", "2", "--output-dir", str(tmp_path / "cut"))  # saves at step 2
    assert first.returncode == 0, first.stderr[-3000:]
    rest = torchrun(*args, "--steps", "4", "--resume", "--output-dir", str(tmp_path / "cut"))
    assert rest.returncode == 0, rest.stderr[-3000:]
    coef_whole = [r["kl_in_reward/coef"] for r in metrics(tmp_path / "whole")]
    coef_cut = [r["kl_in_reward/coef"] for r in metrics(tmp_path / "cut")]
    # steps 2 and 3 start from the coefficient steps 0 and 1 adapted (from 0.1 again they would not)
    assert coef_whole[2] != 0.1
    assert coef_cut == pytest.approx(coef_whole, rel=1e-6)
