"""A run killed with SIGKILL mid-way and resumed reaches the same final step, from a whole checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from train_utils import ROOT, SMALL, TRAIN, env, metrics, torchrun

STEPS = 6


def _start(out) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN)]
    args = ["--output-dir", str(out), "--steps", str(STEPS), *SMALL]
    # its own session, so the kill reaches torchrun and both ranks (by process group id)
    return subprocess.Popen(
        [*cmd, *args],
        env=env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def test_resume_after_sigkill(tmp_path):
    out = tmp_path / "run"
    proc = _start(out)
    deadline = time.monotonic() + 180
    try:
        while not (out / "checkpoints" / "step-000002").is_dir():
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    before = [r["step"] for r in metrics(out)]
    assert before and max(before) < STEPS - 1, "the run finished before it was killed"

    res = torchrun("--output-dir", str(out), "--steps", str(STEPS), *SMALL, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming at step" in res.stderr
    # every step logged exactly once: steps past the checkpoint that was loaded were redone
    assert [r["step"] for r in metrics(out)] == list(range(STEPS))
    done = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert done[-1] == f"step-{STEPS:06d}" and all(not n.startswith(".tmp") for n in done)


def test_resume_with_changed_options_is_refused(tmp_path):
    out = tmp_path / "run"
    res = torchrun("--output-dir", str(out), "--steps", "2", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    res = torchrun("--output-dir", str(out), "--steps", "2", *SMALL, "--lr", "0.1", "--resume")
    assert res.returncode != 0
    assert "--resume with different options: lr" in res.stderr
