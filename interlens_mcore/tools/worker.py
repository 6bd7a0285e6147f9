"""A tool worker process: reads tool calls as JSON lines, runs each under limits, answers in JSON.

`pool.WorkerPool` runs this file as `__main__` (not as a module of the package), so a worker
imports only its tools' modules, and this package only when a tool lives in it. One JSON object a
line each way, the worker answering each request in turn:

    parent -> worker   {"hello": {"sys_path": [...], "modules": [...]}}    once, first
                       {"load": MODULE}                                    import a tool's module
                       {"call": "MODULE:NAME", "name": ..., "arguments": {...},
                        "cpu_s": number | null, "memory_bytes": int | null, "max_chars": int}
    worker -> parent   {"ready": true, "loaded": [...]}                    after the hello
                       {"ok": bool, "text": str}                           after a load or call

A call runs with `RLIMIT_CPU` at the CPU time used so far plus `cpu_s` (the kernel ends the
worker past it) and `RLIMIT_AS` at the address space held so far plus `memory_bytes` (an
allocation past it raises MemoryError, which the tool reports); both are lifted when the call
ends, so imports and idle time never count. Whatever the tool raises, `BaseException`s such as
`SystemExit` and `KeyboardInterrupt` included, and whatever making its result's text raises,
becomes the answer's text. The worker's own stdin and stdout carry only the protocol: a tool
that reads stdin reads nothing, what it prints goes to stderr. A worker whose trainer's end of
the pipe is gone (the trainer exited, or gave up on it before it was ready) exits quietly.

The functions above `main` also serve tools run in the trainer's process (`environment`).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import os
import resource
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import BinaryIO, TypedDict, cast


class CallRequest(TypedDict):
    """A call's line of the protocol (parent -> worker)."""

    call: str  # MODULE:QUALNAME
    name: str
    arguments: dict[str, object]  # the JSON object the policy wrote
    cpu_s: float | None
    memory_bytes: int | None
    max_chars: int


def resolve(reference: str) -> Callable[..., object]:
    """The object named by `MODULE:QUALNAME`, the module imported if need be."""
    module, _, qualname = reference.partition(":")
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    # called by `run_call`, which reports a TypeError if it is not callable after all
    return cast(Callable[..., object], obj)


def type_name(obj: object) -> str:
    try:
        return str(type(obj).__name__)
    except BaseException:  # a metaclass can make even the name raise
        return "object"


def describe(exc: BaseException) -> str:
    """`Kind: message` of an exception, even one whose message raises when read."""
    kind = type_name(exc)
    try:
        message = str(exc)
    except BaseException as inner:
        message = f"<its message could not be read: {type_name(inner)}>"
    return f"{kind}: {message}" if message else kind


def result_text(value: object) -> str:
    """What the policy reads of a tool's value: a string as it is, anything else by its repr."""
    return str.__str__(value) if isinstance(value, str) else repr(value)


def settle(name: str, value: object) -> tuple[bool, str]:
    """(True, text) of a tool's value, or (False, why) when its text cannot be made."""
    try:
        return True, result_text(value)
    except BaseException as exc:
        why = describe(exc)
        return False, f"tool {name!r} returned a {type_name(value)} whose text could not be made: {why}"


def failed(name: str, exc: BaseException) -> tuple[bool, str]:
    return False, f"tool {name!r} raised {describe(exc)}"


def cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"... ({len(text) - max_chars} characters cut)"


def run_call(name: str, fn: Callable[..., object], arguments: Mapping[str, object]) -> tuple[bool, str]:
    """fn(**arguments), awaited if it hands back an awaitable, as (ok, text); never raises."""
    try:
        value = fn(**arguments)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
    except BaseException as exc:
        return failed(name, exc)
    return settle(name, value)


async def _awaited(awaitable: Awaitable[object]) -> object:
    return await awaitable


# -- the worker process -----------------------------------------------------------------------
def _address_space() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * resource.getpagesize()
    except OSError:
        raise OSError(
            "a memory limit is measured from /proc/self/statm (Linux), which cannot be read here; "
            "use WorkerLimits(memory_mb=None) on this system"
        ) from None


@contextmanager
def _limits(cpu_s: float | None, memory_bytes: int | None) -> Iterator[None]:
    """CPU time and address space of one call, on top of what the worker has used so far."""
    cpu_before = resource.getrlimit(resource.RLIMIT_CPU)
    as_before = resource.getrlimit(resource.RLIMIT_AS)
    if cpu_s is not None:
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = math.ceil(used.ru_utime + used.ru_stime + cpu_s)
        resource.setrlimit(resource.RLIMIT_CPU, (_below(soft, cpu_before[1]), cpu_before[1]))
    if memory_bytes is not None:
        soft = _address_space() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (_below(soft, as_before[1]), as_before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_CPU, cpu_before)
        resource.setrlimit(resource.RLIMIT_AS, as_before)


def _below(soft: int, hard: int) -> int:
    return soft if hard == resource.RLIM_INFINITY else min(soft, hard)


class _Worker:
    """The worker's state: its tools' modules and functions, and its protocol streams."""

    def __init__(self, requests: BinaryIO, replies: BinaryIO):
        self.requests, self.replies = requests, replies
        self.functions: dict[str, Callable[..., object]] = {}

    def send(self, message: Mapping[str, object]) -> None:
        self.replies.write(json.dumps(message).encode() + b"\n")
        self.replies.flush()

    def load(self, module: str) -> tuple[bool, str]:
        try:
            importlib.import_module(module)
        except BaseException as exc:
            return False, cut(describe(exc), 2000)
        return True, ""

    def call(self, request: CallRequest) -> tuple[bool, str]:
        name, reference = request["name"], request["call"]
        try:
            fn = self.functions.get(reference) or resolve(reference)
        except BaseException as exc:
            return False, f"tool {name!r} could not be found in its worker process: {describe(exc)}"
        self.functions[reference] = fn
        with _limits(request["cpu_s"], request["memory_bytes"]):
            ok, text = run_call(name, fn, request["arguments"])
            return ok, cut(text, request["max_chars"])

    def serve(self) -> None:
        hello = json.loads(self.requests.readline())["hello"]
        sys.path[:] = hello["sys_path"]
        loaded = [m for m in hello["modules"] if self.load(m)[0]]
        self.send({"ready": True, "loaded": loaded})
        for line in self.requests:
            request = json.loads(line)
            try:
                ok, text = self.load(request["load"]) if "load" in request else self.call(request)
            except BaseException as exc:  # the worker's own failure while answering, MemoryError say
                who = f"tool {request['name']!r}" if "name" in request else "the tool worker"
                ok, text = False, f"{who} could not be run in its worker process: {describe(exc)}"
            self.send({"ok": ok, "text": text})


def _watch_parent(parent: int) -> None:
    # a worker whose trainer died is an orphan: nobody will read its answer
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a call killed for CPU time leaves no core file
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        _Worker(requests, replies).serve()
    except BrokenPipeError:
        # the trainer's end is gone (it exited, or gave up on this worker before it was ready):
        # nobody reads an answer, and a traceback would only clutter the trainer's terminal.
        # os._exit: a normal exit would flush the broken pipe once more and print about it
        os._exit(0)


if __name__ == "__main__":
    main()
