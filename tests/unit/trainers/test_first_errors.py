"""trainers/report/first_errors.py: a failed sample's cause said once, with the line that raised,
then only counted; the site comes from the failure itself (rollout/outcome.failure_reason)."""

from __future__ import annotations

from interlens_mcore.rollout.outcome import failure_reason, failure_site
from interlens_mcore.types import Status, Trajectory, TrajectoryInfo
from trainers.report.failures import step_failures
from trainers.report.first_errors import FirstErrors


def _failed(conversation: str, row: int) -> Trajectory:
    try:
        {"a": 1}[f"row {row}"]  # the line the site names
    except KeyError as exc:
        reason = failure_reason("environment", exc)
    info = TrajectoryInfo(conversation=conversation, stop_reason=reason)
    return Trajectory(token_ids=[1], loss_mask=[0], rollout_logprobs=None, status=Status.FAILED, infos=info)


def test_each_cause_is_said_once_with_its_line_then_counted():
    line = _failed.__code__.co_firstlineno + 2  # the lookup that raises
    site = f"{__file__}:{line}"
    ok = Trajectory(token_ids=[1], loss_mask=[1], rollout_logprobs=None)
    first = FirstErrors()
    step0 = step_failures([_failed("s0-a", 1), ok, _failed("s0-b", 2)], step=0)
    assert step0.failed[0].site == site == failure_site(step0.failed[0].reason)
    # two samples of one cause (their texts differ): one line, naming the first sample and the line
    assert first.new(step0) == [
        f"sample s0-a failed at step 0: environment: KeyError: 'row 1' at {site} "
        "(samples that fail alike are counted and said at the end)"
    ]
    assert first.new(step_failures([_failed("s1-a", 3)], step=1)) == []  # said already
    assert first.repeats() == [
        f"3 samples failed with environment: KeyError at {site} (the first: s0-a, step 0)"
    ]


def test_a_cause_that_failed_once_has_no_count_at_the_end():
    first = FirstErrors()
    assert len(first.new(step_failures([_failed("s0-a", 1)], step=0))) == 1
    assert first.repeats() == []
    assert failure_site("scheduler: ValueError: never raised here") is None
