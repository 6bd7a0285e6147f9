"""torchrun, keeping the launch scripts' promises: a refused run is one line and exit code 2, and
SIGTERM or Ctrl-C lets the workers finish their step, save, and the run exit 0.

    python launch/run.py --nproc_per_node=2 launch/train_grpo.py --output-dir runs/grpo
    python launch/run.py --nproc_per_node=2 --max-restarts 3 launch/train_grpo.py --resume auto ...

Every torchrun option works: this is torch.distributed.run's own parser and agent, started
from here. What differs is what happens around the workers. Plain torchrun (torch 2.13):
- when a worker exits non-zero, its agent raises ChildFailedError: a traceback and a report of
  about 40 lines, and exit code 1 whatever the worker's own code was;
- on SIGTERM or SIGINT it passes the signal on, waits for the workers (at most
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds, 30 by default), then raises: a traceback and exit
  code 1, even when the workers saved and exited 0.
Here the agent's log lines are dropped; a worker group whose first failure exited 2 (a refusal:
its one line is already printed) exits 2 silently; this process passes SIGTERM and SIGINT to
the workers itself and waits for them, so a run stopped at a step boundary ends as they do,
with 0; any other failure is one line naming the rank and its exit code.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGINT)


def _quiet_agent() -> None:
    # the agent's loggers propagate to torch.distributed's stderr handler: cut them off there
    # (a NullHandler, so that logging's last-resort handler does not print them instead)
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logger = logging.getLogger(name)
        logger.addHandler(logging.NullHandler())
        logger.propagate = False


def _children() -> list[int]:
    """This process's child processes (the workers: torchrun starts each in a session of its own)."""
    me, out = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            out.append(int(stat.parent.name))
    return out


class _Forwarder:
    """Passes SIGTERM and SIGINT on to the workers; remembers the first."""

    def __init__(self) -> None:
        self.first: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.first = self.first or signum
        for pid in _children():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass  # it ended meanwhile


def _failed(exc, forwarded: int | None) -> int:
    """The exit code (and line) of a failed worker group."""
    rank, failure = exc.get_first_failure()
    if failure.exitcode == 2:
        return 2  # a refusal: the worker said why in one line
    if forwarded is not None and failure.exitcode == -forwarded:
        name = signal.Signals(forwarded).name
        print(f"run.py: stopped by {name} before the workers could save", file=sys.stderr)
        return 128 + forwarded
    code = failure.exitcode
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    print(f"run.py: error: rank {rank} ended with {how} (its own output above says why)", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    # the agent would turn these into an exception and stop waiting for the workers' exit codes
    names = {s.name for s in FORWARDED}
    args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",") if s.strip() not in names)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets, without its banner
    _quiet_agent()
    forward = _Forwarder()
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        run(args)
    except ChildFailedError as exc:
        return _failed(exc, forward.first)
    except SignalException as exc:  # SIGHUP / SIGQUIT: the agent stopped the workers itself
        print(f"run.py: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + exc.sigval
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
