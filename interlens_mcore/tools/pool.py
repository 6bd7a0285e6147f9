"""Tool calls in worker processes, so that no tool can hold the trainer's process.

A tool that spins in C code holds the GIL: run in a thread of the trainer it stalls the whole
rank, its time limit included, and a thread cannot be killed. So each call runs in a worker
process (`worker.py`) and the trainer only waits on a pipe: at the call's time limit the
worker is killed (SIGKILL) and replaced, and the other calls of the round, in other workers,
go on. Inside the worker a call also runs under `RLIMIT_CPU` and `RLIMIT_AS`
(`WorkerLimits.cpu_s`, `memory_mb`), which hold even when the trainer is not looking (a rank
blocked in a collective, or gone).

Start-up: a worker is a fresh Python (`subprocess`, fork + exec: forking the trainer itself,
with its threads and CUDA state, is unsafe) that imports the tools' modules once, then serves
calls one at a time. A pool keeps `workers` of them per trainer process, started when tools
are first offered (`with_tools`, a `ToolEnvironment`: they import while the trainer loads its
model) and each replaced when it is killed. The time limit of a call counts from when a ready worker
receives it, so start-up and imports never count against a tool; `start_timeout_s` bounds them.
Nor against a step: a `ToolEnvironment` waits for its pool's workers to be ready when it is built
(`wait_ready`), before any step's clock starts. A worker imports only its tools' modules (this
package's own tools need no torch), so a fresh one is ready in a fraction of a second.

What crosses the pipe: JSON lines only. A call names its tool as `MODULE:QUALNAME` (the worker
imports it) with its JSON arguments as the policy wrote them; the answer is `{"ok", "text"}`,
the text the policy reads. Nothing is unpickled from a worker: it runs code driven by the
policy's output, so whatever it sends is untrusted, and JSON decodes to data only.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .worker import CallRequest, describe

WORKER_FILE = Path(__file__).with_name("worker.py")
# run the worker file as __main__, so starting a worker imports no package
_BOOTSTRAP = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
_MAX_REPLY_BYTES = 16 * 2**20  # far above any answer the worker sends (it cuts its texts)


@dataclass(frozen=True, kw_only=True)
class WorkerLimits:
    """How tools run in worker processes: how many, and the limits of one call."""

    workers: int = 4  # worker processes per trainer process; more calls at once wait for one
    cpu_s: float | None = None  # CPU seconds of one call; None: the call's time limit, if any
    memory_mb: int | None = 2048  # memory one call may add to its worker's; None: no limit
    start_timeout_s: float = 120.0  # for a worker to start and import its tools' modules

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise ValueError(f"WorkerLimits.workers must be an integer >= 1, got {self.workers!r}")
        for name in ("cpu_s", "memory_mb", "start_timeout_s"):
            value = getattr(self, name)
            if name != "start_timeout_s" and value is None:
                continue
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value <= 0:
                raise ValueError(f"WorkerLimits.{name} must be a finite number > 0, got {value!r}")


class _Stopped(Exception):
    """The call's worker is killed; the message completes `tool 'name' ...` for the policy."""


class _Died(Exception):
    """The worker closed its end of the pipe: it exited, or was killed."""


class _Worker:
    """One worker process and the trainer's end of its pipes."""

    def __init__(self, modules: Iterable[str]):
        hello = {"hello": {"sys_path": list(sys.path), "modules": sorted(modules)}}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, str(WORKER_FILE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C at the terminal is the trainer's to handle, not the tools'
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(hello).encode() + b"\n")  # small: the pipe's buffer takes it
        self.proc.stdin.flush()
        self.out, self.inp = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self.out, False)
        os.set_blocking(self.inp, False)
        self.buffer = bytearray()
        self.ready = False
        self.modules: set[str] = set()

    async def send(self, message: Mapping[str, object], deadline: float | None) -> None:
        data = memoryview(json.dumps(message).encode() + b"\n")
        while data:
            try:
                data = data[os.write(self.out, data) :]
            except BlockingIOError:
                await _io_ready(self.out, deadline, write=True)
            except (BrokenPipeError, OSError) as exc:
                raise _Died from exc

    async def receive(self, deadline: float | None) -> object:
        while b"\n" not in self.buffer:
            if not self._fill():
                await _io_ready(self.inp, deadline, write=False)
        return self._line()

    def receive_now(self, deadline: float) -> object:
        """`receive`, blocking this thread: for waits outside any event loop (`WorkerPool.wait_ready`)."""
        while b"\n" not in self.buffer:
            if self._fill():
                continue
            if not select.select([self.inp], [], [], max(deadline - time.monotonic(), 0.0))[0]:
                raise TimeoutError
        return self._line()

    def send_now(self, message: Mapping[str, object]) -> None:
        """A short message (a `load`), written at once: the pipe's buffer takes it."""
        try:
            os.write(self.out, json.dumps(message).encode() + b"\n")
        except OSError as exc:  # BrokenPipeError among them; a full pipe (BlockingIOError) too
            raise _Died from exc

    def _fill(self) -> bool:
        """Read what the pipe holds into the buffer; False when it holds nothing yet."""
        if len(self.buffer) > _MAX_REPLY_BYTES:
            raise ValueError(f"an answer longer than {_MAX_REPLY_BYTES} bytes")
        try:
            chunk = os.read(self.inp, 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            raise _Died
        self.buffer += chunk
        return True

    def _line(self) -> object:
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer = bytearray(rest)
        return json.loads(line)

    async def exit_status(self) -> int | None:
        """The worker's exit status once it has closed its pipe; None if it does not exit soon."""
        for _ in range(200):
            if self.proc.poll() is not None:
                return self.proc.returncode
            await asyncio.sleep(0.01)
        return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()  # type: ignore[union-attr]
            except OSError:
                pass


async def _io_ready(fd: int, deadline: float | None, *, write: bool) -> None:
    """Wait until `fd` can be written (or read), or raise TimeoutError at the deadline."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add(fd, wake)
    try:
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        done, _ = await asyncio.wait({ready}, timeout=timeout)
        if not done:
            raise TimeoutError
    finally:
        remove(fd)


def _how_it_ended(status: int | None) -> str:
    if status is None:
        return "it closed its pipe"
    if status < 0:
        try:
            return f"signal {signal.Signals(-status).name}"
        except ValueError:
            return f"signal {-status}"
    return f"exit status {status}"


class WorkerPool:
    """Up to `limits.workers` worker processes shared by every tool environment of a process.

    `call` may be awaited from any event loop (each rollout round may run its own); the pool
    keeps no loop's objects between calls.
    """

    def __init__(self, limits: WorkerLimits):
        self.limits = limits
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._dying: list[_Worker] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._modules: set[str] = set()
        self._closed = False

    def prepare(self, modules: Iterable[str]) -> None:
        """Import `modules` in every worker from now on; start the workers if none is running.

        Started here, the workers import their tools while the trainer gets ready, so a
        round's first calls rarely wait for one.
        """
        with self._lock:
            self._modules.update(modules)
            if not self._closed and not self._idle and not self._busy:
                self._idle.extend(_Worker(self._modules) for _ in range(self.limits.workers))

    def wait_ready(self) -> None:
        """Wait (blocking, up to `limits.start_timeout_s`) until every idle worker has started and
        imported every module `prepare` named.

        A `ToolEnvironment` calls it when it is built, before any step's clock starts: a cold
        worker takes a few seconds to start on a loaded machine, which would otherwise count
        against the first round's step time limit. A worker that does not come up in time, or
        dies, is replaced; a module that fails to import is left for the call to report.
        """
        with self._lock:
            modules = set(self._modules)
            todo = [w for w in self._idle if not w.ready or not modules <= w.modules]
            for w in todo:  # held as busy meanwhile: no call takes a worker that is half ready
                self._idle.remove(w)
                self._busy.add(w)
        deadline = time.monotonic() + self.limits.start_timeout_s
        for w in todo:
            self._release(w, self._greet(w, modules, deadline))

    def _greet(self, worker: _Worker, modules: set[str], deadline: float) -> bool:
        """Bring `worker` to ready with `modules` imported (blocking); False if it is unusable."""
        try:
            if not worker.ready:
                worker.modules, worker.ready = _loaded(worker.receive_now(deadline)), True
            for module in sorted(modules - worker.modules):
                worker.send_now({"load": module})
                ok, _ = _checked(worker.receive_now(deadline))
                if ok:
                    worker.modules.add(module)
        except (TimeoutError, _Died, ValueError, KeyError, TypeError, RecursionError):
            return False
        return True

    async def call(
        self,
        name: str,
        reference: str,
        arguments: dict[str, object],
        *,
        timeout_s: float | None,
        max_chars: int,
    ) -> tuple[bool, str]:
        """(True, text) of a tool's result, or (False, why); raises nothing but cancellation."""
        try:
            worker = await self._acquire()
        except Exception as exc:  # no process could be started (too many processes, say)
            return False, f"tool {name!r}: no worker process could be started ({describe(exc)})"
        keep = False
        try:
            outcome = await self._run(worker, name, reference, arguments, timeout_s, max_chars)
            keep = True
            return outcome
        except _Stopped as stop:
            return False, f"tool {name!r} {stop}"
        except Exception as exc:  # the pool's own failure (out of file descriptors, say)
            return False, f"tool {name!r}: its worker process failed ({describe(exc)}) and was stopped"
        finally:  # a cancelled call's worker is mid-call: it is stopped too
            self._release(worker, keep)

    async def _run(
        self,
        worker: _Worker,
        name: str,
        reference: str,
        arguments: dict[str, object],
        timeout_s: float | None,
        max_chars: int,
    ) -> tuple[bool, str]:
        module = reference.partition(":")[0]
        if not worker.ready or module not in worker.modules:
            problem = await self._start(worker, module)
            if problem is not None:
                return False, f"tool {name!r} could not be imported in its worker process: {problem}"
        cpu_s = self.limits.cpu_s if self.limits.cpu_s is not None else timeout_s
        memory = None if self.limits.memory_mb is None else int(self.limits.memory_mb * 2**20)
        request = CallRequest(
            call=reference,
            name=name,
            arguments=arguments,
            cpu_s=cpu_s,
            memory_bytes=memory,
            max_chars=max_chars,
        )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            await worker.send(request, deadline)
            return _checked(await worker.receive(deadline))
        except TimeoutError:
            raise _Stopped(f"ran past {timeout_s:g} s (its worker process was killed)") from None
        except _Died:
            raise _Stopped(await self._death(worker, cpu_s)) from None
        except (ValueError, RecursionError) as exc:  # not JSON, too long, or not an answer
            raise _Stopped(
                f"got a malformed answer from its worker process ({exc}), which was killed"
            ) from None

    async def _start(self, worker: _Worker, module: str) -> str | None:
        """Bring `worker` to ready with `module` imported; the import's error, or None."""
        deadline = time.monotonic() + self.limits.start_timeout_s
        try:
            if not worker.ready:
                hello = await worker.receive(deadline)
                worker.ready, worker.modules = True, _loaded(hello)
            if module in worker.modules:
                return None
            await worker.send({"load": module}, deadline)
            ok, text = _checked(await worker.receive(deadline))
        except TimeoutError:
            raise _Stopped(
                f"waited {self.limits.start_timeout_s:g} s for its worker process to start"
            ) from None
        except _Died:
            raise _Stopped(
                f"could not start its worker process ({_how_it_ended(await worker.exit_status())})"
            ) from None
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise _Stopped(
                f"got a malformed answer from its worker process ({exc}), which was killed"
            ) from None
        if ok:
            worker.modules.add(module)
        return None if ok else text

    async def _death(self, worker: _Worker, cpu_s: float | None) -> str:
        status = await worker.exit_status()
        if status == -signal.SIGXCPU and cpu_s is not None:
            return f"used more than {cpu_s:g} s of CPU time (the kernel stopped its worker process)"
        return f"ended its worker process ({_how_it_ended(status)})"

    async def _acquire(self) -> _Worker:
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                self._dying = [w for w in self._dying if w.proc.poll() is None]
                if self._closed:
                    raise RuntimeError("the tool worker pool is closed")
                worker = self._take()
                if worker is not None:
                    self._busy.add(worker)
                    return worker
                woken = loop.create_future()
                self._waiters.append((loop, woken))
            await woken

    def _take(self) -> _Worker | None:
        if self._idle:
            return self._idle.pop()
        if len(self._busy) < self.limits.workers:
            return _Worker(self._modules)
        return None

    def _release(self, worker: _Worker, keep: bool) -> None:
        with self._lock:
            self._busy.discard(worker)
            if keep and not self._closed:
                self._idle.append(worker)
            else:
                worker.kill()
                self._dying.append(worker)
                if not self._closed and not self._idle:  # a replacement starts at once
                    self._replace()
            waiters, self._waiters = self._waiters, []
        for loop, woken in waiters:
            try:
                loop.call_soon_threadsafe(_wake, woken)
            except RuntimeError:  # that loop is closed: its caller is gone
                pass

    def _replace(self) -> None:
        try:
            self._idle.append(_Worker(self._modules))
        except OSError:  # the next call tries again, and reports what stops it
            pass

    def close(self) -> None:
        """Stop every worker; calls in progress end as stopped."""
        with self._lock:
            self._closed = True
            workers = [*self._idle, *self._busy]
            self._idle = []
        for worker in workers:
            worker.kill()
        for worker in [*workers, *self._dying]:
            try:
                worker.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _wake(woken: asyncio.Future) -> None:
    if not woken.done():
        woken.set_result(None)


def _checked(reply: object) -> tuple[bool, str]:
    """The (ok, text) of a worker's answer, or ValueError if it is not one."""
    if isinstance(reply, dict):
        ok, text = reply.get("ok"), reply.get("text")
        if isinstance(ok, bool) and isinstance(text, str):
            return ok, text
    raise ValueError("expected {'ok': bool, 'text': str}")


def _loaded(hello: object) -> set[str]:
    """The modules a worker's first answer says it imported (KeyError or TypeError if malformed)."""
    if not isinstance(hello, dict):
        raise TypeError(f"expected a JSON object, got {type(hello).__name__}")
    return set(hello["loaded"])


_POOLS: dict[tuple[int, WorkerLimits], WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(limits: WorkerLimits) -> WorkerPool:
    """The pool of this process for `limits` (a forked child gets its own, not its parent's)."""
    key = (os.getpid(), limits)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = WorkerPool(limits)
        return _POOLS[key]


@atexit.register
def _close_pools() -> None:
    for (pid, _), pool in list(_POOLS.items()):
        if pid == os.getpid():
            pool.close()
