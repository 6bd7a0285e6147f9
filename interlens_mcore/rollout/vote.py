"""The termination vote: before every round each rank says whether it still has work and
whether it failed. Everyone keeps calling the (collective) engine while anyone has work, and
one rank's failure becomes the same `RolloutError` on every rank instead of a hang.

A `gather_fn` follows accelerate's `gather_object` convention: each rank passes a list and
gets the concatenation over ranks, in rank order. `local_gather` is the one-process identity;
`distributed.build_groups(...).gather_fn()` is the distributed one.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GatherFn = Callable[[list[object]], list[object]]


class RolloutError(RuntimeError):
    """A rank of the rollout group failed; raised on every rank of the group alike."""

    def __init__(self, failures: list[tuple[int, str]]):
        self.failures = failures
        lines = "; ".join(f"rank {r}: {msg}" for r, msg in failures)
        super().__init__(f"rollout failed on {len(failures)} rank(s): {lines}")


class RolloutValueError(RolloutError, ValueError):
    """Bad input on some rank: still a RolloutError everywhere, and a ValueError too."""


def local_gather(items: list[object]) -> list[object]:
    """The single-process gather_fn."""
    return list(items)


@dataclass
class Ballot:
    """One rank's vote for one round."""

    rank: int
    active: bool
    error: str | None = None  # "ExceptionType: message" of a local failure
    bad_input: bool = False  # the failure was a ValueError (a user's bad input)
    payload: dict[str, Any] = field(default_factory=dict)  # e.g. engine calls needed this round


def describe(exc: BaseException) -> str:
    """Short, picklable description of an exception, with its notes and innermost frame.

    The notes carry what a runner added on the way up (the conversation or hook it came from).
    """
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    notes = "".join(f" [{n}]" for n in getattr(exc, "__notes__", ()))
    return f"{type(exc).__name__}: {exc}{notes}{where}"


def cast_vote(
    gather_fn: GatherFn,
    *,
    rank: int,
    active: bool,
    error: BaseException | None = None,
    payload: dict[str, Any] | None = None,
) -> list[Ballot]:
    """Gather every rank's ballot; raise the same RolloutError everywhere if any rank failed."""
    mine = Ballot(
        rank,
        active,
        describe(error) if error is not None else None,
        isinstance(error, ValueError),
        payload or {},
    )
    ballots = [_ballot(b) for b in gather_fn([mine])]
    failed = [(b.rank, b.error, b.bad_input) for b in ballots if b.error is not None]
    if failed:
        cls = RolloutValueError if all(bad for _, _, bad in failed) else RolloutError
        raise cls([(r, e) for r, e, _ in failed]) from error
    return ballots


def _ballot(item: object) -> Ballot:
    if not isinstance(item, Ballot):
        raise TypeError(f"gather_fn returned {type(item).__name__}; expected every rank's Ballot, in order")
    return item
