"""Time limits of environment, tool and scheduler steps.

`call_limited` and `await_limited` run one user call under a limit of seconds and raise
`StepTimeout` when it runs past it; the runners (`co_step`, `run_multi_turn`) end that
conversation or request with status TIMEOUT rather than failing the rollout.

Two choices make a limit hold for code that never returns. A synchronous call runs in a
daemon thread, not an executor's worker: a thread cannot be killed, and a daemon one neither
blocks the interpreter's exit nor `asyncio.run`'s shutdown of the default executor. An awaited
call is awaited through `asyncio.wait` and cancelled at the limit; `asyncio.wait` rather than
`asyncio.wait_for`, so a `TimeoutError` the call raises itself stays the call's error.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

T = TypeVar("T")


async def maybe_await(value: object) -> object:
    """`value`, awaited if it is awaitable (a hook that may be sync or async)."""
    return await value if inspect.isawaitable(value) else value


class StepTimeout(Exception):
    """A limited call ran past its limit (raised by the helpers below, caught by the runners)."""


def check_time_limit(value: object, where: str) -> None:
    """Raise ValueError naming `where` unless `value` is None or a finite number of seconds > 0."""
    ok = value is None or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )
    if not ok:
        raise ValueError(f"{where} must be a number of seconds > 0 or None, got {value!r}")


def _in_daemon_thread(
    fn: Callable[..., object], args: tuple[object, ...], deliver: Callable[[bool, object], None]
) -> None:
    """Run fn(*args) in a daemon thread and hand (ok, value or exception) to `deliver`.

    Daemon, and not an executor's worker: a call that never returns must neither block the
    interpreter's exit nor `asyncio.run`'s shutdown of the default executor.
    """

    def run() -> None:
        try:
            result = (True, fn(*args))
        except BaseException as exc:  # handed to the caller, which re-raises it
            result = (False, exc)
        deliver(*result)

    threading.Thread(target=run, daemon=True, name="interlens-limited-step").start()


def call_limited(fn: Callable[..., T], *args: object, limit: float | None) -> T:
    """fn(*args) for a synchronous fn; raise StepTimeout if it has not returned after `limit` s.

    With a limit the call runs in a daemon thread. A thread cannot be killed: after a
    timeout it may still finish later, and what it returns (or raises) is discarded.
    """
    if limit is None:
        return fn(*args)
    box: list[tuple[bool, object]] = []
    done = threading.Event()

    def deliver(ok: bool, value: object) -> None:
        box.append((ok, value))
        done.set()

    _in_daemon_thread(fn, args, deliver)
    if not done.wait(limit):
        raise StepTimeout
    ok, value = box[0]
    if not ok:
        raise cast(BaseException, value)
    return cast(T, value)


async def await_limited(
    fn: Callable[..., object],
    *args: object,
    limit: float | None,
    serial: asyncio.Lock,
    threaded: bool = False,
) -> Any:  # what the user's call returned, sync or async: the caller checks it
    """fn(*args), sync or async, awaited; raise StepTimeout once `limit` s have passed.

    Without a limit an async fn is awaited and a sync one runs inline, as they always have
    (in a daemon thread all the same with `threaded`). With one, an async fn is awaited under
    the limit and cancelled when it expires; a sync fn runs in a daemon thread, one at a time
    under `serial` (sync code was never called concurrently), its limit counted from when it
    starts. The thread cannot be killed: after a timeout it may still be running while the next
    sync call starts, so a sync step that can time out must tolerate that; what it returns is
    discarded.
    """
    if limit is None and not threaded:
        return await maybe_await(fn(*args))
    if inspect.iscoroutinefunction(fn):
        return await _within(cast(Awaitable[object], fn(*args)), limit)
    loop = asyncio.get_running_loop()
    async with serial:
        start, future = time.monotonic(), loop.create_future()

        def deliver(ok: bool, value: object) -> None:
            try:
                loop.call_soon_threadsafe(_settle, future, ok, value)
            except RuntimeError:  # the loop is closed: the caller gave up on this call long ago
                pass

        _in_daemon_thread(fn, args, deliver)
        value = await _within(future, limit)
    if inspect.isawaitable(value):  # a sync fn that hands back a coroutine: the rest of the limit
        value = await _within(value, None if limit is None else limit - (time.monotonic() - start))
    return value


def _settle(future: asyncio.Future[object], ok: bool, value: object) -> None:
    if not future.done():  # a timed-out call's future was cancelled
        future.set_result(value) if ok else future.set_exception(cast(BaseException, value))


async def _within(awaitable: Awaitable[T], limit: float | None) -> T:
    # asyncio.wait rather than wait_for: a TimeoutError raised by the call itself stays an error
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=None if limit is None else max(limit, 0.0))
    if task not in done:
        task.cancel()
        raise StepTimeout
    return task.result()
