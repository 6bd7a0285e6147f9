"""No stage where a user's code runs can hang the world: the fault-injection matrix under torchrun.

For each layout (Megatron TP=1 x DP=2, where every rank votes alone; Megatron TP=2, one
rollout group; DeepSpeed ZeRO-3, whose rollout group is the DP group) `fault_matrix_job.py`
raises on rank 0 only and on rank 1 only, at every stage a user's code runs (a training
rollout's environment, an evaluation rollout's environment, a reward function, `success_of`,
a tool, a scheduler hook), at the first step and at a later one: 24 cases a layout. Every case
must end on both ranks with the same named cause within 10 s of the fault, or run on to the
end: a tool's error, which the policy reads, and a reward function's, which fails the samples
it raised for. A case that hangs leaves the job short of its
lines and the deadline fails the test.

The last test runs the command of the report that found the hang: an environment that raises
on about one reply in ten, evaluated every 100 steps, 2 ranks; before, rank 0 waited in the
evaluation figures' gather while rank 1 waited in the world check, for 30 minutes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.launch import ROOT, TRAIN, env, kill_all

JOB = Path(__file__).with_name("fault_matrix_job.py")
sys.path.insert(0, str(JOB.parent))
from fault_matrix_job import GOES_ON, ISOLATED, STEPS, cases  # noqa: E402

LAYOUTS = {
    "megatron-tp1-dp2": ["--backend", "megatron", "--tp", "1"],
    "megatron-tp2": ["--backend", "megatron", "--tp", "2"],
    "deepspeed-zero3-dp2": ["--backend", "deepspeed", "--zero-stage", "3"],
}


def _torchrun(args: list[str], *, cwd: Path, timeout: float, log_dir: Path | None = None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    if log_dir is not None:  # each rank's own stdout and stderr in a file of its own
        cmd += ["--log-dir", str(log_dir), "--redirects", "3"]
    proc = subprocess.Popen(
        [*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=cwd
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# the default layout in the README's command; TP=2 and ZeRO-3 (not first paths) in the slow stage
@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=[pytest.mark.slow] if k != "megatron-tp1-dp2" else []) for k in LAYOUTS]
)
def test_every_injected_fault_ends_both_ranks_named_or_is_counted(tmp_path, layout):
    out = tmp_path / "cases.jsonl"
    res = _torchrun([str(JOB), *LAYOUTS[layout], "--out", str(out)], cwd=ROOT, timeout=420)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    assert res.returncode == 0 and len(lines) == len(cases()), (len(lines), res.stderr[-3000:])
    for case in lines:
        name = f"{layout}: {case['stage']} raising on rank {case['rank']} at the {case['when']} step"
        ranks, failing = case["ranks"], case["ranks"][case["rank"]]
        assert failing["fired"] > 0 and all(r["fired"] == 0 for r in ranks if r is not failing), name
        if case["stage"] in GOES_ON:
            # the policy read the tool's error and the run went on to its last step everywhere
            assert [r["ended"] for r in ranks] == ["ran", "ran"], name
            assert all(r["steps"] == list(range(STEPS)) for r in ranks), name
            # each failed call was an error line the policy read, counted where it happened
            assert [r["tool_errors"] for r in ranks] == [r["fired"] for r in ranks], name
            continue
        if case["stage"] in ISOLATED:
            # the batch call raised, then each of the rank's 4 samples alone: all 4 FAILED, and
            # the run went on to its last step everywhere
            assert [r["ended"] for r in ranks] == ["ran", "ran"], name
            assert all(r["steps"] == list(range(STEPS)) for r in ranks), name
            assert failing["fired"] == 1 + 4, name
            continue
        assert [r["ended"] for r in ranks] == ["failed", "failed"], name
        messages = {r["message"] for r in ranks}
        assert len(messages) == 1, (name, messages)  # the same named cause on every rank
        message = messages.pop()
        assert re.match(r"rank \d failed: ", message), (name, message)
        assert f"injected fault: {case['stage']} on rank {case['rank']}" in message, (name, message)
        waited = max(r["ended_at"] for r in ranks) - failing["fired_at"]
        assert waited < 10.0, (name, waited)


FLAKY = """
import zlib
from dataclasses import dataclass

from interlens_mcore import Environment, Message
from interlens_mcore.tasks import TaskSource


class Judge(Environment):
    name = "judge"

    def respond(self, conv):
        reply = conv.messages[-1].content
        if zlib.crc32(reply.encode()) % 10 == 0:
            raise RuntimeError("flaky judge")
        conv.infos["success"] = float(any(c.isdigit() for c in reply))
        conv.request_stop("judged")
        return "thanks"

    def reward(self, conv):
        return conv.infos["success"]


@dataclass(frozen=True)
class SayNumber:
    max_turns: int = 2

    def prompt(self):
        return [Message(speaker="user", content="say a number")]

    def lineup(self, seat):
        return [seat("policy"), Judge()]


class Numbers(TaskSource):
    name = "numbers"

    def rows(self, n, *, seed):
        return [SayNumber() for _ in range(n)]

    def eval_rows(self, n, *, seed):
        return [SayNumber() for _ in range(n)]


def make_tasks():
    return Numbers()
"""


def test_a_flaky_environment_in_evaluation_ends_both_ranks_named(tmp_path):
    (tmp_path / "flaky.py").write_text(FLAKY)
    logs = tmp_path / "logs"
    args = [str(TRAIN), "--task", "flaky:make_tasks", "--steps", "4", "--eval-size", "8"]
    args += ["--on-sample-error", "raise"]  # fail fast (by default the judge's error ends its sample only)
    start = time.monotonic()
    res = _torchrun([*args, "--output-dir", str(tmp_path / "run")], cwd=tmp_path, timeout=300, log_dir=logs)
    elapsed = time.monotonic() - start
    assert res.returncode == 1, res.stderr[-3000:]
    per_rank = sorted(logs.rglob("stderr.log"))
    assert len(per_rank) == 2, per_rank
    last = [[ln for ln in p.read_text().splitlines() if ln.strip()][-1] for p in per_rank]
    # each rank's last line is the same named cause
    assert last[0] == last[1], last
    assert re.match(r"train_grpo\.py: error: rank \d failed: .*RuntimeError: flaky judge", last[0]), last
    assert elapsed < 120, elapsed  # start-up and a few steps; a hang is killed at 300 s
