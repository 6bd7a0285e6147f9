"""SIGTERM (a scheduler's notice before preemption) and SIGINT (Ctrl-C): the run finishes its step,
saves it, and `--resume` continues without redoing a step.

Runs stop on their own only at --steps; checkpoints are due every 50 steps, so each checkpoint
found after a stop is the one the signal wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.launch import ROOT, SMALL, TRAIN, children, env, kill_all, metrics, torchrun

# the slow stage: the real torchrun agent's signals, restarts and kills (seconds of cold launches
# each); .ci/run runs it after the README's command
pytestmark = pytest.mark.slow

RUN = ROOT / "launch" / "run.py"
STEPS = 30
ARGS = [*SMALL, "--steps", str(STEPS), "--save-every", "50"]  # the later --save-every wins


def _start(out: Path, *, launcher: list[str]) -> subprocess.Popen:
    cmd = [*launcher, "--standalone", "--nproc_per_node=2", str(TRAIN), "--output-dir", str(out), *ARGS]
    return subprocess.Popen(
        cmd, env=env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
WRAPPED = [sys.executable, str(RUN)]


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait_for_steps(proc: subprocess.Popen, out: Path, n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while _steps_logged(out) < n:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"fewer than {n} steps within {timeout} s"
        time.sleep(0.2)


def _finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        raise
    return err


def _saved_steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))


def _resume_continues(out: Path, stopped_at: int, launcher: str = "torchrun") -> None:
    if launcher == "torchrun":
        res = torchrun("--output-dir", str(out), *ARGS, "--resume", timeout=400)
    else:
        cmd = [*WRAPPED, "--standalone", "--nproc_per_node=2", str(TRAIN), "--output-dir", str(out), *ARGS]
        res = subprocess.run(
            [*cmd, "--resume"], env=env(), cwd=ROOT, capture_output=True, text=True, timeout=400
        )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resuming at step {stopped_at} of {STEPS}" in res.stderr
    # every step once: none redone after the stop, none skipped
    assert [r["step"] for r in metrics(out)] == list(range(STEPS))


def test_sigterm_to_the_torchrun_agent_saves_the_step_and_resume_redoes_none(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, launcher=TORCHRUN)
    try:
        _wait_for_steps(proc, out, 2)
        proc.send_signal(signal.SIGTERM)  # the agent passes it on to both workers
        err = _finish(proc)
    finally:
        if proc.poll() is None:
            kill_all(proc)
    stopped_at = len(metrics(out))
    assert 2 <= stopped_at < STEPS, err[-3000:]
    assert _saved_steps(out) == [stopped_at]  # the signal's checkpoint holds the last whole step
    said = [line for line in err.splitlines() if line.startswith("train_grpo.py:")]
    assert said == [
        f"train_grpo.py: stopped by SIGTERM after step {stopped_at} of {STEPS}: saved "
        f"{out / 'checkpoints' / f'step-{stopped_at:06d}'}; --resume continues"
    ], err[-3000:]
    # plain torchrun itself ends on the signal with its own traceback and exit code 1 (launch/run.py
    # ends with the workers' 0: the next test); what matters here is that the step was saved
    _resume_continues(out, stopped_at)


def test_ctrl_c_under_launch_run_saves_and_exits_0_without_a_traceback(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, launcher=WRAPPED)
    try:
        _wait_for_steps(proc, out, 2)
        proc.send_signal(signal.SIGINT)  # what a terminal sends to its foreground process
        err = _finish(proc)
    finally:
        if proc.poll() is None:
            kill_all(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    stopped_at = len(metrics(out))
    assert _saved_steps(out) == [stopped_at]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"train_grpo.py: stopped by SIGINT after step {stopped_at} of {STEPS}: saved")
    _resume_continues(out, stopped_at, launcher="run")


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, launcher=TORCHRUN)
    try:
        _wait_for_steps(proc, out, 2)
        rank1 = next(pid for pid in children(proc.pid) if "\0RANK=1\0" in _environ(pid))
        os.kill(rank1, signal.SIGTERM)  # rank 0 never gets a signal: it stops because rank 1 asked
        err = _finish(proc)
    finally:
        if proc.poll() is None:
            kill_all(proc)
    assert proc.returncode == 0, err[-3000:]  # both workers exited 0: torchrun too
    stopped_at = len(metrics(out))
    [saved] = _saved_steps(out)
    assert saved == stopped_at
    folder = out / "checkpoints" / f"step-{saved:06d}"
    for rank in (0, 1):  # each rank's state is of the same step
        assert json.loads((folder / f"trainer-rank{rank:05d}.json").read_text())["step"] == saved


def _environ(pid: int) -> str:
    return "\0" + Path(f"/proc/{pid}/environ").read_text() + "\0"
