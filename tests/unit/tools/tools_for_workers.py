"""Tools the tool-isolation tests call: module-level functions of the standard library only.

A worker process imports a tool's module by name; this one imports fast, so workers start in
well under a second even on a loaded machine.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def spin_in_c(seconds: float) -> str:
    """Spin in one C call for about `seconds`, holding the GIL all along.

    Args:
        seconds: how long
    """
    start = time.perf_counter()
    sum(range(10**6))
    per_second = 10**6 / (time.perf_counter() - start)
    sum(range(int(per_second * seconds)))  # one C call: no bytecode boundary to drop the GIL at
    return "spun"


async def block(seconds: float) -> str:
    """An async tool that blocks its event loop.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "blocked"


def spin(seconds: float) -> str:
    """Spin in Python, burning CPU time.

    Args:
        seconds: how long
    """
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "spun"


def allocate(megabytes: int) -> int:
    """Allocate and touch memory.

    Args:
        megabytes: how much
    """
    return len(bytearray(megabytes * 2**20))


def exits(code: int) -> str:
    """Call sys.exit.

    Args:
        code: the exit status
    """
    sys.exit(code)


def interrupts(x: int) -> str:
    """Raise KeyboardInterrupt.

    Args:
        x: anything
    """
    raise KeyboardInterrupt


async def interrupts_async(x: int) -> str:
    """Raise KeyboardInterrupt from a coroutine.

    Args:
        x: anything
    """
    await asyncio.sleep(0)
    raise KeyboardInterrupt


async def cancels_itself(x: int) -> str:
    """Raise CancelledError though nobody cancelled it.

    Args:
        x: anything
    """
    raise asyncio.CancelledError


class _Unshowable:
    def __repr__(self) -> str:
        raise ValueError("no repr for you")


def unshowable(x: int) -> object:
    """Return a value whose repr raises.

    Args:
        x: anything
    """
    return _Unshowable()


class _Unspeakable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message either")


def unspeakable(x: int) -> str:
    """Raise an exception whose str raises.

    Args:
        x: anything
    """
    raise _Unspeakable


def exits_hard(code: int) -> str:
    """End the process at once (os._exit).

    Args:
        code: the exit status
    """
    os._exit(code)


def chatty(x: int) -> str:
    """Print to stdout and read stdin: neither touches the worker's protocol.

    Args:
        x: anything
    """
    print("a tool printing to stdout")
    return f"read {sys.stdin.read()!r}"


def forges(x: int) -> str:
    """Write bytes that are not an answer into every pipe it can reach.

    Args:
        x: anything
    """
    for fd in range(3, 256):
        try:
            os.write(fd, b"\x80\x04\x95 a pickle, not JSON\n")
        except OSError:
            pass
    return "forged"
