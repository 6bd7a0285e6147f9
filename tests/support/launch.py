"""Run the launch scripts as a user would: torchrun (or python) in a subprocess with a deadline."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from support.dist import cold, free_port
from support.warm import WarmLauncher, differs_at_import

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "launch" / "train_grpo.py"
# a few small steps: every test run stays well under a minute on 2 cores
SMALL = ["--batch-size", "8", "--num-generations", "4", "--max-new-tokens", "4", "--save-every", "2"]
SMALL += ["--eval-size", "4"]


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    # the launch scripts import the package as installed; this checkout's copy comes first, so a
    # test runs the code beside it even where another checkout is the installed one
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    e.pop("PYTHONWARNINGS", None)  # bad-input tests check that stderr holds exactly one line
    e.update(extra)
    return e


def children(pid: int) -> list[int]:
    """Direct children of `pid` (torchrun starts its workers in sessions of their own)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker it started."""
    for pid in [*children(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


_warm: list[WarmLauncher] = []


def _asked(environ: dict[str, str], extra_env: dict[str, str]) -> dict[str, str]:
    """What a run sets on purpose: the test's own variables and those `env` sets."""
    return {k: environ[k] for k in {*extra_env, "PYTHONPATH", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM"}}


def _warm_launcher() -> WarmLauncher:
    """This session's warm launcher (support.warm), started on first use."""
    if not _warm:
        _warm.append(WarmLauncher(env(), ROOT))
        atexit.register(_warm[0].close)
    return _warm[0]


def torchrun(
    *args: str,
    nproc: int = 2,
    timeout: float = 240,
    script: Path = TRAIN,
    cwd: Path = ROOT,
    warm: bool = True,
    **extra_env: str,
) -> subprocess.CompletedProcess:
    """Run to completion; on timeout kill torchrun *and* its workers, which would outlive it.

    `warm` (the default): the ranks are forked from support.warm's server, which has the training
    stack imported, unless the run's environment differs from the server's in a variable read at
    import time. `warm=False`: the real torchrun, for a test that reads torchrun's own output or
    needs its agent (restarts, signals)."""
    environ = env(**extra_env)
    if warm and not cold():
        launcher = _warm_launcher()
        if not differs_at_import(_asked(environ, extra_env), launcher.environ):
            done = launcher.run(script, list(args), nproc, environ, cwd, timeout)
            if done is not None:
                return done
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
    ]
    proc = subprocess.Popen(
        [*cmd, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environ,
        cwd=cwd,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def nodes(
    *args: str, count: int = 2, timeout: float = 300, cwd: Path = ROOT, **extra_env: str
) -> list[subprocess.CompletedProcess]:
    """`launch/multinode.sh ARGS` started `count` times, one process a "node" (a c10d rendezvous on
    127.0.0.1), as a multi-node job starts it on each node; every one run to completion. On timeout
    every launcher and worker is killed."""
    port = free_port()
    procs = []
    for rank in range(count):
        node = dict(NNODES=str(count), NODE_RANK=str(rank), NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1")
        node.update(MASTER_PORT=str(port), LOCAL_ADDR="127.0.0.1", RDZV_ID=f"test-{port}")
        procs.append(
            subprocess.Popen(
                ["bash", str(ROOT / "launch" / "multinode.sh"), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env(**node, **extra_env),
                cwd=cwd,
            )
        )
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_all(proc)
        raise
    return done


def python(
    *args: str, timeout: float = 120, warm: bool = True, **extra_env: str
) -> subprocess.CompletedProcess:
    """`python launch/train_grpo.py ARGS` (one process, no process group), warm as `torchrun`."""
    environ = env(**extra_env)
    if warm and not cold():
        launcher = _warm_launcher()
        if not differs_at_import(_asked(environ, extra_env), launcher.environ):
            done = launcher.run(TRAIN, list(args), 1, environ, ROOT, timeout, torchrun=False)
            if done is not None:
                return done
    cmd = [sys.executable, str(TRAIN), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=environ, cwd=ROOT)


def metrics(out: Path) -> list[dict]:
    """The training steps' current records (the end-of-run evaluation line left out: see
    `evaluations`; lines a resumption superseded left out: see `all_records`)."""
    return [r for r in all_records(out) if "reward_mean" in r and not r.get("superseded")]


def all_records(out: Path) -> list[dict]:
    """Every line of metrics.jsonl, superseded ones included."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def trained(out: Path, steps: int = 3) -> list[dict]:
    """The step records of a finished run of `steps` steps, checked: one per step, and the held-out
    `eval/success_rate` (a share) before training and after it."""
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(steps))
    evals = [r for r in all_records(out) if "eval/success_rate" in r]
    assert [r["step"] for r in evals] == [0, steps]
    assert all(0.0 <= r["eval/success_rate"] <= 1.0 for r in evals)
    return rows


def evaluations(out: Path) -> list[dict]:
    """Every current record holding evaluation figures, the end-of-run one (step == steps) included."""
    return [r for r in all_records(out) if any(k.startswith("eval/") for k in r) and not r.get("superseded")]


def train_main():
    """`launch/train_grpo.py`'s `main` in this process (for the checks that run before any process group)."""
    import importlib

    launch = str(ROOT / "launch")
    if launch not in sys.path:
        sys.path.insert(0, launch)
    return importlib.import_module("train_grpo").main
