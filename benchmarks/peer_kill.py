"""How long a surviving rank takes to fail when its peer is SIGKILLed, over gloo.

    python benchmarks/peer_kill.py

Two processes, gloo, the trainers' default timeout (1800 s). Rank 1 SIGKILLs itself while
rank 0 is in a collective (`all_reduce`, `all_gather_object`, `check_world`), or while rank 0
is still computing and enters the collective 2 s after the kill ("late"). Then the same under
torchrun, with rank 0 busy for 10 minutes without a collective (a long rollout): the seconds
from the kill until torchrun has stopped the survivor and exited ("torchrun_busy"). Prints
one JSON line: for each case, the seconds after the kill and the survivor's first error line.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

CASES = ("all_reduce", "all_gather_object", "check_world", "all_reduce_late")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, case: str, kill_file: str, queue) -> None:
    import torch.distributed as dist

    from interlens_mcore import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=1800))
    group = distributed.world_check_group(timeout_s=1800) if case == "check_world" else None
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)  # rank 0 is blocked in the collective by now (or computing, when late)
        Path(kill_file).write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if case.endswith("_late"):
        time.sleep(3.0)  # busy elsewhere while the peer dies
    try:
        if case.startswith("all_reduce"):
            dist.all_reduce(torch.ones(4))
        elif case == "all_gather_object":
            out = [None, None]
            dist.all_gather_object(out, {"rank": rank})
        else:
            distributed.check_world(None, group)
        queue.put(("returned", time.time()))
    except BaseException as exc:  # what the user would read as the last line
        queue.put((f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}", time.time()))


def measure(case: str) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    kill_file = f"/tmp/peer_kill_{os.getpid()}_{case}"
    procs = [ctx.Process(target=_rank, args=(r, port, case, kill_file, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        message, at = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    killed_at = float(Path(kill_file).read_text())
    os.unlink(kill_file)
    return {"seconds_after_kill": round(at - killed_at, 3), "error": message}


def _torchrun_worker(kill_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(1.0)
        Path(kill_file).write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # a long rollout: no collective to notice the loss


def measure_torchrun() -> dict:
    import subprocess

    kill_file = f"/tmp/peer_kill_{os.getpid()}_torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*cmd, __file__, "--torchrun-worker", kill_file], capture_output=True, text=True, timeout=300
    )
    ended = time.time()
    killed_at = float(Path(kill_file).read_text())
    os.unlink(kill_file)
    signals = [line.strip() for line in done.stderr.splitlines() if "exitcode" in line and "(pid" in line]
    return {
        "seconds_after_kill": round(ended - killed_at, 3),
        "torchrun_rc": done.returncode,
        "workers": signals,
    }


def main() -> None:
    cases = {c: measure(c) for c in CASES}
    cases["torchrun_busy"] = measure_torchrun()
    print(json.dumps({"benchmark": "peer_kill", "timeout_s": 1800, **cases}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--torchrun-worker"]:
        _torchrun_worker(sys.argv[2])
    else:
        main()
