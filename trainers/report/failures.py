"""Samples that failed (status FAILED) in a step: counted over the world, per cause, and the check
that ends a run whose samples mostly fail.

A failed sample's `infos.stop_reason` names its cause first (`"scheduler: KeyError: 'x'"`,
`"environment: ..."`, `"reward accuracy: ..."`): the text before the first ':' is the cause the
figures count. `step_failures` gathers every rank's failed samples (collective, one
`all_gather_object`), so every rank decides alike whether the step's failed share ends the run::

    failures = step_failures(rollout.trajectories, step)   # every rank calls it
    failures.check(max_failed_fraction)                    # TooManyFailures on every rank, or nothing
    record.update(failures.figures())                      # failed_samples, failed/<cause>
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from interlens_mcore import distributed
from interlens_mcore.rollout.outcome import failure_site
from interlens_mcore.types import Status, Trajectory

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_SHOWN = 200  # characters of the example's reason in the line that ends a run


class TooManyFailures(Exception):
    """More of a step's samples failed than --max-failed-fraction allows (raised on every rank)."""


@dataclass(frozen=True)
class FailedSample:
    cause: str  # the stop reason's first word: scheduler, environment, tool, reward ...
    reason: str  # the whole stop reason
    conversation: str  # the sample's id
    site: str | None = None  # file:line the exception was raised at (None: not known)


def cause_of(reason: str | None) -> str:
    """The first word of the reason's head: `"scheduler: ValueError: x"` -> `"scheduler"`,
    `"reward accuracy: KeyError: 'x'"` -> `"reward"`; a reason that names no cause is "unknown"."""
    text = reason or ""
    head = text.split(":", 1)[0].split()
    return head[0] if head and ":" in text else "unknown"


def failed_samples(trajectories: Sequence[Trajectory]) -> list[FailedSample]:
    """This rank's failed samples, in order."""
    return [
        FailedSample(
            cause=cause_of(t.infos.stop_reason),
            reason=t.infos.stop_reason or "no reason given",
            conversation=t.infos.conversation or f"index {t.infos.index}",
            site=failure_site(t.infos.stop_reason),
        )
        for t in trajectories
        if t.status is Status.FAILED
    ]


@dataclass(frozen=True)
class StepFailures:
    """Every rank's failed samples of one step, and how many samples the step had."""

    step: int
    total: int
    failed: list[FailedSample]  # in rank order

    def figures(self) -> dict[str, int]:
        """`failed_samples` (always) and `failed/<cause>` for each cause present."""
        causes = Counter(f.cause for f in self.failed)
        return {"failed_samples": len(self.failed), **{f"failed/{c}": n for c, n in sorted(causes.items())}}

    def check(self, max_fraction: float) -> None:
        """Raise TooManyFailures when the failed share exceeds `max_fraction`."""
        if self.total and len(self.failed) / self.total > max_fraction:
            raise TooManyFailures(self.line(max_fraction))

    def line(self, max_fraction: float) -> str:
        """`16 of 16 samples failed at step 0 (scheduler: ValueError: ... in conversation X); ...`."""
        commonest, _ = Counter(f.cause for f in self.failed).most_common(1)[0]
        example = next(f for f in self.failed if f.cause == commonest)
        reason = " ".join(example.reason.split())  # one line, whatever the exception's text
        if len(reason) > _SHOWN:
            reason = reason[:_SHOWN] + " ..."
        return (
            f"{len(self.failed)} of {self.total} samples failed at step {self.step} "
            f"({reason} in conversation {example.conversation}); --max-failed-fraction {max_fraction:g}; "
            "--on-sample-error raise stops the run at the first one instead"
        )


def step_failures(
    trajectories: Sequence[Trajectory], step: int, group: ProcessGroup | None = None
) -> StepFailures:
    """The failed samples of every rank of `group` (default: the world); collective."""
    parts = distributed.all_gather_object((len(trajectories), failed_samples(trajectories)), group=group)
    return StepFailures(step=step, total=sum(n for n, _ in parts), failed=[f for _, fs in parts for f in fs])
