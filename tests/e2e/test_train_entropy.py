"""Short runs of launch/train_grpo.py with the entropy bonus, the top-entropy mask and a named loss."""

from __future__ import annotations

import math

from support.launch import SMALL, metrics, python, torchrun


def _check(rows, steps):
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        assert math.isfinite(r["loss"]) and r["tokens"] > 0
        assert 0.0 < r["entropy"] < math.log(200_000)


def test_sapo_with_entropy_bonus_and_top_entropy_mask(tmp_path):
    out = tmp_path / "run"
    args = ["--entropy-coeff", "0.01", "--top-entropy-quantile", "0.5", "--policy-loss", "sapo"]
    res = python("--output-dir", str(out), "--steps", "2", *args, *SMALL, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    _check(rows, 2)
    for r in rows:
        # at most half of the loss tokens lie below the median entropy (ties keep the loss)
        assert 0.0 < r["entropy/masked_fraction"] <= 0.5
        assert r["clip_fraction"] == 0.0  # sapo's soft gate clips nothing


# the bonus under TP=2 (vocab-parallel entropy): tests/e2e/test_train_pipeline.py's TP=2 run


def test_top_entropy_mask_over_two_dp_ranks_with_geo_mean(tmp_path):
    # the threshold is the 0.7 quantile of both ranks' loss-token entropies (a collective)
    out = tmp_path / "run"
    args = [
        "--top-entropy-quantile",
        "0.3",
        "--policy-loss",
        "geo_mean",
        "--aggregation",
        "seq-mean-token-mean",
    ]
    res = torchrun("--output-dir", str(out), "--steps", "2", *args, *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    _check(rows, 2)
    assert all(0.5 <= r["entropy/masked_fraction"] < 1.0 for r in rows)


def test_entropy_bonus_on_deepspeed(tmp_path):
    out = tmp_path / "run"
    args = [
        "--backend",
        "deepspeed",
        "--zero-stage",
        "1",
        "--entropy-coeff",
        "0.01",
        "--policy-loss",
        "kl_cov",
    ]
    res = torchrun("--output-dir", str(out), "--steps", "2", *args, *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    _check(rows, 2)
    assert all(r["grad_norm"] > 0 and math.isfinite(r["grad_norm"]) for r in rows)
