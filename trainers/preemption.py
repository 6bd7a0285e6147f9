"""Stopping at a step boundary on SIGTERM or SIGINT: the run saves its last step and ends cleanly.

A cluster scheduler sends SIGTERM before it preempts a job, and Ctrl-C sends SIGINT. With
`TrainerConfig.save_on_signal` (the default) the first of either only notes the signal; the
GRPO loop asks `StopRequest.agreed` at every step boundary, a collective every rank reaches, so
all ranks stop after the same step even when the signal reached them at different moments. The
run then writes its checkpoint and `train()` returns normally. A second signal acts as it would
without this module (SIGINT raises KeyboardInterrupt, SIGTERM ends the process): the first one
restores the handlers that were there before.

Under torchrun the agent passes SIGTERM and SIGINT on to every worker, then waits
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 by default) before it kills them: a step and a
checkpoint must fit in that time (raise it for long steps).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import torch

from interlens_mcore import distributed

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# what signal.getsignal returns: a handler, SIG_DFL / SIG_IGN, or None (set outside Python)
Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []  # this process's signals since `hold` (the handler only appends)
_previous: dict[int, Handler] = {}


def _note(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    for sig, handler in _previous.items():  # a second signal acts as it would without us
        signal.signal(sig, handler)
    _previous.clear()


def hold() -> None:
    """Note SIGTERM and SIGINT from now on instead of stopping (main thread only; idempotent)."""
    if threading.current_thread() is not threading.main_thread():
        raise ValueError(
            "TrainerConfig.save_on_signal needs train() in the main thread (signal handlers are "
            "installed there); pass save_on_signal=False to train in another thread"
        )
    if _previous or _received:
        return  # installed, or already fired (the second signal is the user's to act on)
    for sig in SIGNALS:
        _previous[sig] = signal.signal(sig, _note)


def release() -> None:
    """Put back the handlers `hold` replaced, and forget any signal noted."""
    for sig, handler in _previous.items():
        signal.signal(sig, handler)
    _previous.clear()
    _received.clear()


def received() -> int | None:
    """The first signal noted on this rank, or None."""
    return _received[0] if _received else None


class StopRequest:
    """The loop's view of the signals: `agreed` is the same on every rank at a step boundary."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.signal: int | None = None  # set once every rank agreed to stop

    @property
    def stopped(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def start(self) -> None:
        if self.enabled:
            hold()

    def agreed(self, group: ProcessGroup | None = None) -> bool:
        """Collective over `group` (every rank of the world, gloo): True when any rank got a signal."""
        if not self.enabled:
            return False
        mine = torch.tensor([received() or 0], dtype=torch.int64)
        signum = int(distributed.all_reduce(mine, "max", group=group)[0])
        if signum:
            self.signal = signum
        return self.stopped

    def finish(self) -> None:
        if self.enabled:
            release()
