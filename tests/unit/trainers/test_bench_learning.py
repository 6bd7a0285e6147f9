"""The learning benchmark's parts that decide its figures: the rows TRL gets, TRL's reward, the aims."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_learning as bl  # noqa: E402

from interlens_mcore.engines.sampler import mix_seed  # noqa: E402


def _curve(*points):
    return [
        {"step": s, "samples": 32 * s, "wall_s": w, "accuracy": a, "low": a - 0.05, "high": a + 0.05}
        for s, w, a in points
    ]


def test_aims_at_equal_samples_and_the_wall_time_to_trls_final_accuracy():
    trl = {"curve": _curve((0, 0, 0.1), (10, 100, 0.3), (20, 200, 0.4)), "train_wall_s": 200.0}
    ahead = {"curve": _curve((0, 0, 0.1), (10, 90, 0.42), (20, 180, 0.45))}
    out = bl.aims(ahead, trl)
    assert out["equal_samples_met"] and out["trl_final_accuracy"] == 0.4
    assert out["ours_wall_to_trl_final_over_trl_wall"] == 0.45 and out["wall_aim_met"]
    # below TRL's interval at step 10; never at TRL's final accuracy: no ratio
    behind = {"curve": _curve((0, 0, 0.1), (10, 90, 0.2), (20, 180, 0.39))}
    out = bl.aims(behind, trl)
    assert [e["ok"] for e in out["equal_samples"]] == [True, False, True] and not out["equal_samples_met"]
    assert out["ours_wall_to_trl_final_over_trl_wall"] is None and not out["wall_aim_met"]


def test_trl_gets_our_ranks_rows_in_order_and_scores_them_with_the_verifier():
    cfg = bl.recipe(bl.CONFIG)
    per_step = bl.trained_rows(cfg, steps=2, seed=0)
    src = bl.task_source(cfg)
    per_rank = cfg["batch_size"] // cfg["num_generations"]
    for step, rows in enumerate(per_step):
        want = [r for rank in range(2) for r in src.rows(per_rank, seed=mix_seed(0, step, rank))]
        assert [r.entry["question"] for r in rows] == [r.entry["question"] for r in want]
    rows = [r for step in per_step for r in step]
    reward = bl.verifier_for(rows)
    right, wrong = rows[1].entry["answer"], "<answer>not a number</answer>"
    completions = [[{"content": f"so <answer>{right}</answer>"}], [{"content": wrong}], f"it is {right}"]
    # the answer tag, a wrong answer, and the recipe's fallback (the reply's last number)
    assert reward(completions, row=[1, 1, 1]) == [1.0, 0.0, 1.0]


def test_bad_step_counts_are_refused_naming_the_flags(capsys):
    with pytest.raises(SystemExit):
        bl.main(["--steps", "25", "--eval-every", "10"])
    assert "--steps must be >= 2 and a multiple of --eval-every, got --steps 25 --eval-every 10" in (
        capsys.readouterr().err
    )
