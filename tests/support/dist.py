"""Run a function on N real gloo processes with a deadline, so a hang is a test failure."""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, environ, path):
    import datetime

    import torch
    import torch.distributed as dist

    # as a spawned process would: the caller's environment and import path of now, not the fork
    # server's of when it started
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException as exc:  # reported to the parent, which fails the test
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


# what every rank's function needs first; the fork server imports it once per test session, so a
# rank starts in a fraction of a second instead of importing torch and megatron-core again
PRELOAD = ["torch.distributed", "megatron.core", "deepspeed", "transformers", "support.dist"]


def cold() -> bool:
    """INTERLENS_TESTS_COLD=1: every process the tests start imports everything itself, as a
    user's does (spawned ranks, the real torchrun); the vLLM stage runs so."""
    return os.environ.get("INTERLENS_TESTS_COLD") == "1"


def _context():
    """A fork server with the training stack imported: each rank is a fresh fork of a process that
    has started no thread and opened no process group, so it is as clean as a spawned one."""
    if cold():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(fn, world_size: int = 2, *args, timeout: float = 120.0, expect_errors: bool = False):
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank.

    `fn` must be a module-level function (it is pickled). Raises TimeoutError if any rank has
    not reported within `timeout` seconds (the processes are killed), RuntimeError if a rank
    raised, unless `expect_errors`, in which case {rank: ("ok"|"error", payload)} is returned.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, queue, dict(os.environ), list(sys.path)),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    try:
        import queue as queue_mod
        import time

        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(results))} did not finish "
                    f"within {timeout:.0f}s (hang?)"
                )
            try:
                r, status, payload = queue.get(timeout=min(remaining, 1.0))
                results[r] = (status, payload)
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and len(results) < world_size:
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if all(i not in results for i in dead):
                        raise RuntimeError(f"ranks {dead} died without reporting") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if expect_errors:
        return results
    errors = {r: payload for r, (status, payload) in results.items() if status == "error"}
    if errors:
        raise RuntimeError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [results[r][1] for r in range(world_size)]
