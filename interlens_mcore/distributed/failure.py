"""Failing together: one rank's error reaches every rank of the world as the same named cause."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from .collectives import _describe, _group_ranks, all_gather_small, is_initialized, rank, world_size

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class WorldFailure(RuntimeError):
    """A rank of the world failed (or left); raised on every rank with the same message.

    `failures` holds (global rank, "ExceptionType: message") of every rank that reported an
    error; it is empty when a peer disappeared without reporting (killed, or out of memory).
    """

    def __init__(self, failures: list[tuple[int, str]], *, lost: str | None = None) -> None:
        self.failures, self.lost = failures, lost
        if failures:
            rank_, cause = failures[0]
            rest = [str(r) for r, _ in failures[1:]]
            plural = "s" if len(rest) > 1 else ""
            others = f" (rank{plural} {', '.join(rest)} failed too)" if rest else ""
            message = f"rank {rank_} failed: {cause}{others}"
        else:
            message = f"a rank left the world before reporting ({lost})"
        super().__init__(message)


def world_check_group(*, timeout_s: float) -> ProcessGroup | None:
    """A gloo group over the whole world with its own timeout, for `check_world` (collective).

    The timeout must exceed the longest gap between two ranks reaching the check (a rank that
    failed early waits there while the others finish their rollouts).
    """
    if not is_initialized():
        return None
    return dist.new_group(list(range(world_size())), backend="gloo", timeout=timedelta(seconds=timeout_s))


def check_world(error: BaseException | None, group: ProcessGroup | None = None) -> None:
    """Fail together: every rank calls this at the same point, with its own error or None.

    When any rank passes an error, every rank raises the same `WorldFailure` naming the first
    failing rank and its cause (chained to the local error, if any). A peer that vanished
    (SIGKILL) makes the gloo collective fail at once; that too becomes a `WorldFailure`, so the
    last line every rank prints is a named cause, not a transport error. `group` is a gloo
    group (`world_check_group`): never NCCL, whose watchdog would abort the process instead.
    """
    mine = None if error is None else _describe(error)
    if world_size(group) > 1 and dist.get_backend(group) != "gloo":
        raise ValueError("check_world needs a gloo group (distributed.world_check_group), not the NCCL world")
    if world_size(group) == 1:
        if mine is not None:
            raise WorldFailure([(rank(), mine)]) from error
        return
    try:
        reports = all_gather_small(mine, group=group)
    except RuntimeError as exc:  # gloo's DistBackendError and friends: the peer is gone
        raise WorldFailure([(rank(), mine)] if mine else [], lost=_describe(exc)) from error or exc
    failures = [(r, d) for r, d in zip(_group_ranks(group), reports, strict=True) if d is not None]
    if failures:
        raise WorldFailure(failures) from error
