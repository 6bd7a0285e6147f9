"""Failing samples through launch/train_grpo.py under torchrun (2 ranks, the tiny model): a scheduler
that raises for one sample in ten trains to the end and counts them; one that raises for every
sample ends the run at its first step with one line and exit code 2; `--on-sample-error raise`
fails the run at the first failure as it did before."""

from __future__ import annotations

import json
import subprocess
import sys

from support.launch import ROOT, SMALL, TRAIN, all_records, env, metrics

# only rank 1 fails: rank 0 must keep voting with it, neither hangs (torchrun's deadline)
SCHEDULER = """
import os

from interlens_mcore.compat.swift import MultiTurnScheduler


class OneInTen(MultiTurnScheduler):
    calls = 0

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        OneInTen.calls += 1
        if os.environ["RANK"] == "1" and OneInTen.calls % 10 == 3:
            raise ValueError("this reply is refused")
        return {"done": current_turn >= 2, "rollout_infos": {"reward": float(current_turn)}}

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "again"})
        return {"infer_request": infer_request}


class Always(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        raise KeyError("solution")

    def check_finished(self, infer_request, response_choice, current_turn):
        return False
"""

QUICK = ["--eval-every", "0", "--save-every", "5"]


def _run(tmp_path, scheduler: str, *extra: str, steps: int):
    data = tmp_path / "q.jsonl"
    data.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) + "\n" for i in range(8))
    )
    (tmp_path / "plugin.py").write_text(SCHEDULER)
    out = tmp_path / "run"
    args = ["--external-plugins", "plugin.py", "--multi-turn-scheduler", f"plugin:{scheduler}"]
    args += ["--dataset", str(data), "--steps", str(steps), "--output-dir", str(out), *SMALL, *QUICK, *extra]
    # launch/run.py: torchrun that keeps the script's exit code (2 for a run that ends on failures)
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "--standalone", "--nproc_per_node=2", str(TRAIN)]
    res = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600, env=env(), cwd=tmp_path)
    return res, out


def test_one_sample_in_ten_failing_trains_to_the_end(tmp_path):
    res, out = _run(tmp_path, "OneInTen", steps=10)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(10))
    failed = [r["failed_samples"] for r in rows]  # every step writes it, 0 when none failed
    assert sum(failed) > 0 and max(failed) < 8, failed  # only rank 1's samples, never all of them
    assert all(r.get("failed/scheduler", 0) == r["failed_samples"] for r in rows)
    assert all((r["health/failed_samples"] > 0) == (r["failed_samples"] > 0) for r in rows)
    assert (out / "checkpoints" / "step-000010").is_dir()


def test_every_sample_failing_ends_the_run_at_its_first_step(tmp_path):
    res, out = _run(tmp_path, "Always", steps=3)
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "train_grpo.py: error: 16 of 16 samples failed at step 0 (scheduler: KeyError: 'solution'"
    )
    assert "in conversation s0-r" in last
    assert last.endswith(
        "); --max-failed-fraction 0.5; --on-sample-error raise stops the run at the first one instead"
    )
    assert sum("samples failed at step" in line for line in res.stderr.splitlines()) == 1  # one line
    assert not (out / "metrics.jsonl").is_file() or all_records(out) == []  # no step trained, none logged


def test_on_sample_error_raise_fails_at_the_first_failure(tmp_path):
    res, out = _run(tmp_path, "Always", "--on-sample-error", "raise", steps=3)
    assert res.returncode == 1, res.stderr[-3000:]
    # as before --on-sample-error existed: the first failure ends the run, named on every rank
    assert "train_grpo.py: error: rank 0 failed: KeyError: 'solution' (rank 1 failed too)" in res.stderr
    assert "samples failed at step" not in res.stderr
