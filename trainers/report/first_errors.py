"""Failed samples said on stderr as they happen: each cause once, the first time any rank meets
it, and how often it came back at the end of the run.

A cause is what failed, the exception's type and the line it was raised at (`agent: ValueError`
at `agent.py:12`): a sample that fails alike later is only counted. Rank 0 says it, for every
rank's samples (`StepFailures` holds the world's)::

    first = FirstErrors()
    for line in first.new(failures):   # each step, after step_failures
        warn(line)
    for line in first.repeats():       # at the end of the run
        warn(line)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .failures import FailedSample, StepFailures

_SHOWN = 200  # characters of a reason in its line


def _head(reason: str) -> str:
    """The cause and the exception's type of a reason: `"agent: ValueError"` of
    `"agent: ValueError: no row"` (the whole reason when it names no type)."""
    parts = reason.split(": ", 2)
    return ": ".join(parts[:2]) if len(parts) == 3 else reason


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _SHOWN else text[:_SHOWN] + " ..."


@dataclass
class FirstErrors:
    """The causes of failed samples met so far in the run, with how many samples each failed."""

    counts: dict[tuple[str, str | None], int] = field(default_factory=dict)
    first: dict[tuple[str, str | None], tuple[int, FailedSample]] = field(default_factory=dict)

    def new(self, failures: StepFailures) -> list[str]:
        """One line for each cause this step's failures bring up for the first time."""
        lines = []
        for f in failures.failed:
            key = (_head(f.reason), f.site)
            self.counts[key] = self.counts.get(key, 0) + 1
            if key not in self.first:
                self.first[key] = (failures.step, f)
                at = f" at {f.site}" if f.site else ""
                lines.append(
                    f"sample {f.conversation} failed at step {failures.step}: {_one_line(f.reason)}{at} "
                    "(samples that fail alike are counted and said at the end)"
                )
        return lines

    def repeats(self) -> list[str]:
        """At the end of the run: each cause that failed more than its first sample, with its count."""
        lines = []
        for key, n in self.counts.items():
            if n > 1:
                head, site = key
                step, f = self.first[key]
                at = f" at {site}" if site else ""
                lines.append(f"{n} samples failed with {head}{at} (the first: {f.conversation}, step {step})")
        return lines
