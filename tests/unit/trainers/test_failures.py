"""A step's failed samples: counted per cause, and the one line that ends a run whose samples mostly
failed (on one process: `step_failures` gathers over a world of one)."""

from __future__ import annotations

import json

import pytest

from interlens_mcore.types import Status, Trajectory, TrajectoryInfo
from trainers import rundir
from trainers.config import TrainerConfig
from trainers.report.failures import StepFailures, TooManyFailures, cause_of, failed_samples, step_failures


def _t(status: Status, reason: str | None = None, conversation: str = "c") -> Trajectory:
    return Trajectory(
        token_ids=[1, 2],
        loss_mask=[0, 1],
        rollout_logprobs=None,
        status=status,
        infos=TrajectoryInfo(conversation=conversation, stop_reason=reason),
    )


def test_the_cause_is_the_first_word_of_the_stop_reason():
    assert cause_of("scheduler: MultiTurnValueError: step() changed messages[0]") == "scheduler"
    assert cause_of("reward accuracy: KeyError: 'solution'") == "reward"
    assert cause_of("no colon here") == cause_of(None) == cause_of("") == "unknown"


def test_figures_count_every_failed_sample_by_cause():
    rollout = [
        _t(Status.STOPPED),
        _t(Status.FAILED, "scheduler: ValueError: a", "s0-r0-p0-g1"),
        _t(Status.TIMEOUT, "timeout: env exceeded 1 s at turn 2"),  # not a failure
        _t(Status.FAILED, "environment: KeyError: 'x'", "s0-r0-p1-g0"),
        _t(Status.FAILED, "scheduler: ValueError: b", "s0-r0-p1-g1"),
    ]
    failures = step_failures(rollout, step=3)  # no process group: this process is the world
    assert failures.total == 5
    assert failures.figures() == {"failed_samples": 3, "failed/environment": 1, "failed/scheduler": 2}
    assert step_failures([_t(Status.STOPPED)], step=0).figures() == {"failed_samples": 0}


def test_a_step_over_the_limit_ends_the_run_with_one_line_naming_the_commonest_cause():
    failed = failed_samples(
        [
            _t(Status.FAILED, "environment: KeyError: 'x'", "c0"),
            _t(Status.FAILED, "scheduler: ValueError: step() changed\nmessages[0]", "c1"),
            _t(Status.FAILED, "scheduler: ValueError: other", "c2"),
        ]
    )
    failures = StepFailures(step=1, total=4, failed=failed)
    failures.check(0.75)  # 3 of 4 is not more than 0.75
    with pytest.raises(TooManyFailures) as info:
        failures.check(0.5)
    assert str(info.value) == (
        "3 of 4 samples failed at step 1 (scheduler: ValueError: step() changed messages[0] in "
        "conversation c1); --max-failed-fraction 0.5; --on-sample-error raise stops the run at the "
        "first one instead"
    )
    StepFailures(step=0, total=0, failed=[]).check(0.0)  # an empty step ends nothing


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_max_failed_fraction_is_a_share(bad):
    with pytest.raises(ValueError, match=r"TrainerConfig.max_failed_fraction must be in \[0, 1\]"):
        TrainerConfig(max_failed_fraction=bad)


def test_a_run_ended_by_failures_may_resume_with_another_limit_or_raise(tmp_path):
    run = {"steps": 3, "lr": 1e-3, "max_failed_fraction": 0.5, "on_sample_error": "skip"}
    (tmp_path / rundir.RUN_FILE).write_text(json.dumps(run))
    rundir.check(tmp_path, {**run, "max_failed_fraction": 0.9, "on_sample_error": "raise"}, resume=True)
    with pytest.raises(rundir.RunDirError, match="--resume with different options: lr"):
        rundir.check(tmp_path, {**run, "lr": 1.0}, resume=True)
