"""The health check's rules: when each condition counts, when its one warning line comes, what it says."""

from __future__ import annotations

import pytest

from trainers.report.health import HealthCheck


def _steps(check: HealthCheck, records: list[dict]) -> list[tuple[dict, list[str]]]:
    return [check.check({"step": i, **r}) for i, r in enumerate(records)]


def test_one_warning_after_three_steps_in_a_row_naming_the_flag():
    check = HealthCheck(max_new_tokens=6)
    out = _steps(check, [{"completions/clipped_ratio": 1.0}] * 5)
    assert [f["health/clipped_replies"] for f, _ in out] == [1, 2, 3, 4, 5]
    assert [len(w) for _, w in out] == [0, 0, 1, 0, 0]  # once, when it has held for 3 steps
    line = out[2][1][0]
    assert "--max-new-tokens 6 cuts 100% of replies" in line and "raise --max-new-tokens" in line
    assert "\n" not in line and line.startswith("warning: ")


def test_a_condition_that_clears_starts_over_and_warns_again():
    check = HealthCheck(max_new_tokens=6)
    cut, fine = {"completions/clipped_ratio": 0.95}, {"completions/clipped_ratio": 0.5}
    out = _steps(check, [cut, cut, fine, cut, cut, cut])
    assert [f["health/clipped_replies"] for f, _ in out] == [1, 2, 0, 1, 2, 3]
    assert [len(w) for _, w in out] == [0, 0, 0, 0, 0, 1]


@pytest.mark.parametrize(
    ("key", "bad", "good", "rule", "names"),
    [
        ("frac_reward_zero_std", 1.0, 0.5, "zero_std_groups", ["100% of groups", "--num-generations"]),
        ("truncated_fraction", 1.0, 0.1, "truncated", ["100% of samples outgrew", "--max-turns"]),
        (
            "invalid/ended_fraction",
            0.75,
            0.25,
            "invalid_moves",
            ["75% of samples ended on invalid", "--model"],
        ),
        (
            "completions/clipped_ratio",
            0.9,
            0.89,
            "clipped_replies",
            ["cuts 90% of replies", "--max-new-tokens"],
        ),
        ("tool/calls_per_sample", 0.0, 0.25, "no_tool_calls", ["calls no tool", "--tools"]),
        ("failed_samples", 2, 0, "failed_samples", ["2 samples of the step failed", "--on-sample-error"]),
        ("success_rate", 0.0, 0.05, "no_success", ["no sample reached the task's goal", "--task-arg"]),
    ],
)
def test_each_rule_its_threshold_and_its_cause(key, bad, good, rule, names):
    bad_run = _steps(HealthCheck(max_new_tokens=6), [{key: bad}] * 3)
    assert bad_run[-1][0][f"health/{rule}"] == 3
    (line,) = bad_run[-1][1]
    assert all(n in line for n in names), line
    good_run = _steps(HealthCheck(max_new_tokens=6), [{key: good}] * 3)
    assert all(f[f"health/{rule}"] == 0 and not w for f, w in good_run)


def test_a_figure_the_step_does_not_have_never_warns():
    # no tools offered: no tool/calls_per_sample, so no "calls no tool" warning however long (nor
    # a no-success one from a task that does not judge success)
    out = _steps(HealthCheck(max_new_tokens=6, patience=1), [{"reward_mean": 0.0}] * 4)
    assert all(not w for _, w in out)
    assert set(out[0][0]) == {
        "health/zero_std_groups",
        "health/truncated",
        "health/invalid_moves",
        "health/clipped_replies",
        "health/no_tool_calls",
        "health/failed_samples",
        "health/no_success",
    }
    assert not any(out[0][0].values())


def test_several_conditions_warn_apart_and_a_null_figure_does_not_count():
    bad = {"frac_reward_zero_std": 1.0, "completions/clipped_ratio": 1.0, "truncated_fraction": None}
    out = _steps(HealthCheck(max_new_tokens=4, patience=2), [bad, bad])
    assert len(out[1][1]) == 2 and out[1][0]["health/truncated"] == 0


def test_patience_must_be_positive():
    with pytest.raises(ValueError, match="HealthCheck.patience must be >= 1, got 0"):
        HealthCheck(max_new_tokens=6, patience=0)


def test_slow_steps_warn_after_patience_s_not_after_patience_steps():
    # a CliffWalking step of SmolLM2 on 2 cores takes half an hour: three of them before a
    # warning would be an hour and a half of a run that cannot learn
    check = HealthCheck(max_new_tokens=16)
    slow = {"completions/clipped_ratio": 0.95, "rollout_s": 1500.0, "train_s": 540.0}
    out = _steps(check, [slow, slow, slow])
    assert [len(w) for _, w in out] == [1, 0, 0]  # at the first step, then not again
    assert out[0][1][0].endswith("(for 1 step of 34 min, step 0)")
    # quick steps add up: 4 of 200 s pass 600 s at the third, as the step count does too
    check = HealthCheck(max_new_tokens=16, patience=5)
    quick = {"completions/clipped_ratio": 0.95, "rollout_s": 150.0, "train_s": 50.0}
    out = _steps(check, [quick] * 4)
    assert [len(w) for _, w in out] == [0, 0, 1, 0] and "(for 3 steps in a row of 10 min" in out[2][1][0]
    # time in steps where the condition does not hold does not count
    check = HealthCheck(max_new_tokens=16)
    fine = {"completions/clipped_ratio": 0.1, "rollout_s": 1500.0}
    out = _steps(check, [fine, {**quick, "rollout_s": 10.0}])
    assert [len(w) for _, w in out] == [0, 0]
    with pytest.raises(ValueError, match="HealthCheck.patience_s must be > 0 seconds, got 0"):
        HealthCheck(max_new_tokens=6, patience_s=0)


def test_a_slow_rollout_warns_before_its_update_and_the_step_does_not_warn_again():
    # Taxi with SmolLM2 here: a 12-minute rollout, then a 35-minute update; the warning is due on
    # the rollout alone, so it comes before the update
    check = HealthCheck(max_new_tokens=16)
    rollout = {"step": 0, "invalid/ended_fraction": 0.91, "rollout_s": 748.0}
    (line,) = check.early(rollout)
    assert "91% of samples ended on invalid" in line and line.endswith("(for 1 step of 12 min, step 0)")
    figures, warnings = check.check({**rollout, "train_s": 2082.0})
    assert figures["health/invalid_moves"] == 1 and warnings == []  # counted once, said once
    # early counts nothing: a quick rollout's condition warns at the patience'th step, said once
    check = HealthCheck(max_new_tokens=16)
    quick = {"invalid/ended_fraction": 0.91, "rollout_s": 5.0}
    said = []
    for step in range(4):
        said.append(check.early({"step": step, **quick}))
        said.append(check.check({"step": step, **quick, "train_s": 5.0})[1])
    assert [len(w) for w in said] == [0, 0, 0, 0, 1, 0, 0, 0]  # early, at the third step
    assert check.streaks["invalid_moves"] == 4
