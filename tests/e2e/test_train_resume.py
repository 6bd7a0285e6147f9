"""A run killed with SIGKILL mid-way and resumed reaches the same final step, from a whole checkpoint."""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.launch import (
    ROOT,
    SMALL,
    TRAIN,
    children,
    env,
    evaluations,
    kill_all,
    metrics,
    python,
    torchrun,
)

STEPS = 6


def _start(out, steps: int = STEPS) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN)]
    args = ["--output-dir", str(out), "--steps", str(steps), *SMALL]
    return subprocess.Popen(
        [*cmd, *args],
        env=env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.slow  # a killed or concurrent real torchrun: the slow stage
def test_resume_after_sigkill(tmp_path):
    out = tmp_path / "run"
    proc = _start(out)
    deadline = time.monotonic() + 180
    try:
        while not (out / "checkpoints" / "step-000002").is_dir():
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.2)
        workers = children(proc.pid)
        assert len(workers) == 2
    finally:
        kill_all(proc)
    assert proc.returncode == -signal.SIGKILL
    time.sleep(1)  # the kernel reaps the orphaned workers
    assert not any(Path(f"/proc/{w}").exists() and "Z" not in _state(w) for w in workers)
    before = [r["step"] for r in metrics(out)]
    assert before and max(before) < STEPS - 1, "the run finished before it was killed"

    res = torchrun("--output-dir", str(out), "--steps", str(STEPS), *SMALL, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming at step" in res.stderr
    # every step logged exactly once: steps past the checkpoint that was loaded were redone
    assert [r["step"] for r in metrics(out)] == list(range(STEPS))
    done = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert done[-1] == f"step-{STEPS:06d}" and all(not n.startswith(".tmp") for n in done)


def test_extending_a_run_keeps_every_line_already_written(tmp_path):
    out = tmp_path / "run"
    res = torchrun("--output-dir", str(out), "--steps", "2", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    first = (out / "metrics.jsonl").read_text().splitlines()
    assert json.loads(first[-1]).keys() >= {"step", "eval/success_rate"}  # the final evaluation, step 2
    res = torchrun("--output-dir", str(out), "--steps", "4", *SMALL, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming at step 2 of 4" in res.stderr
    second = (out / "metrics.jsonl").read_text().splitlines()
    assert second[: len(first)] == first  # every line, unchanged and in its place
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3]
    assert [r["step"] for r in evaluations(out)] == [0, 2, 4]


def test_resume_with_changed_options_is_refused(tmp_path):
    out = tmp_path / "run"
    res = torchrun("--output-dir", str(out), "--steps", "2", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    res = torchrun("--output-dir", str(out), "--steps", "2", *SMALL, "--lr", "0.1", "--resume")
    assert res.returncode != 0
    assert (
        f"train_grpo.py: error: --output-dir {out}: --resume with different options: lr "
        "(lr: 0.001 -> 0.1); start a new run in another folder to change them"
    ) in res.stderr.splitlines()


@pytest.mark.slow  # a killed or concurrent real torchrun: the slow stage
def test_second_writer_is_refused(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, steps=1000)  # still running when the second launch arrives
    try:
        deadline = time.monotonic() + 120
        while not (out / "run.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        res = torchrun("--output-dir", str(out), "--steps", "1000", *SMALL, "--resume")
        assert proc.poll() is None and res.returncode != 0
        assert "another process is still writing to it" in res.stderr
    finally:
        kill_all(proc)


@contextlib.contextmanager
def _held(out: Path):
    """`.lock` held as a live run holds it (rundir.lock)."""
    with (out / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield


def test_a_refused_resume_touches_nothing_of_the_live_run(tmp_path):
    out = tmp_path / "run"
    res = python("--output-dir", str(out), "--steps", "2", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    live = out / "checkpoints" / ".tmp-step-000003"  # the live run's checkpoint being written
    live.mkdir()
    (live / "tokenizer.json").write_text("{}")
    with _held(out):
        res = python("--output-dir", str(out), "--steps", "4", *SMALL, "--resume")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"train_grpo.py: error: --output-dir {out}: another process is still writing to it (.lock is held)"
    ]
    assert (live / "tokenizer.json").is_file()
    assert [r["step"] for r in metrics(out)] == [0, 1]


@pytest.mark.slow  # a killed or concurrent real torchrun: the slow stage
def test_resume_auto_refused_by_a_live_run_stays_refused_when_restarted(tmp_path):
    # the second of two `--resume auto` runs in one folder, under torchrun --max-restarts: its
    # restart must not resume the first run once that one finished (here: let go of the folder)
    out = tmp_path / "run"
    res = torchrun("--output-dir", str(out), "--steps", "2", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "--standalone", "--nproc_per_node=2"]
    cmd += [
        "--max-restarts=2",
        str(TRAIN),
        "--output-dir",
        str(out),
        "--steps",
        "2",
        *SMALL,
        "--resume",
        "auto",
    ]
    lines: list[str] = []
    with _held(out):
        proc = subprocess.Popen(
            cmd, env=env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        deadline = time.monotonic() + 240
        while not any(".lock is held" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.1)
    # the folder is free from here on: a restarted attempt that tried again would resume it
    try:
        proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        raise
    reader.join(timeout=30)
    assert proc.returncode == 2, "".join(lines)[-3000:]
    assert lines == [
        f"train_grpo.py: error: --output-dir {out}: another process is still writing to it (.lock is held)\n"
    ]
    assert [r["step"] for r in metrics(out)] == [0, 1]


def test_resume_with_its_checkpoints_deleted_is_refused(tmp_path):
    out = tmp_path / "run"
    res = python("--output-dir", str(out), "--steps", "2", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    shutil.rmtree(out / "checkpoints")
    res = python("--output-dir", str(out), "--steps", "2", *SMALL, "--resume")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"train_grpo.py: error: --resume: step-000002, the newest checkpoint this run wrote, is gone from "
        f"{out / 'checkpoints'}; resuming would redo steps 0..1. Restore it, or train into a new --output-dir"
    ]
    assert [r["step"] for r in metrics(out)] == [0, 1]  # not emptied
