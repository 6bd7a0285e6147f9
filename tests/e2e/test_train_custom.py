"""A user's own task and reward, plugged in from the command line exactly as the README shows:

    torchrun --nproc_per_node=2 launch/train_grpo.py --task mymodule:make_tasks \
        --reward mymodule:reward --steps 3 --report-to jsonl,tensorboard
"""

from __future__ import annotations

import json

from support.launch import SMALL, all_records, metrics, torchrun

MYMODULE = """
from dataclasses import dataclass

from interlens_mcore import Environment, Message
from interlens_mcore.tasks import TaskSource


class Judge(Environment):
    name = "judge"

    def respond(self, conv):
        said = conv.messages[-1].content
        conv.infos["success"] = float(any(c.isdigit() for c in said))
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


def reward(trajectories, rows):
    return [1.0 if len(t.infos.completion) <= 3 else 0.0 for t in trajectories]
"""


def test_custom_task_and_reward_from_the_command_line(tmp_path):
    (tmp_path / "mymodule.py").write_text(MYMODULE)
    out = tmp_path / "out"
    args = ["--task", "mymodule:make_tasks", "--reward", "mymodule:reward", "--steps", "3"]
    args += ["--report-to", "jsonl,tensorboard", "--output-dir", str(out), "--log-completions-every", "1"]
    res = torchrun(*args, *SMALL, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        # the task's own reward (env) and the user's, each logged apart; their sum is the reward
        assert r["reward_mean"] == pytest_approx(r["reward/env"] + r["reward/reward"])
        assert 0.0 <= r["success_rate"] <= 1.0
    evals = [r for r in all_records(out) if "eval/success_rate" in r]
    assert [r["step"] for r in evals] == [0, 3]  # before training and after the last step
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert {c["step"] for c in completions} == {0, 1, 2} and all(
        "say a number" in c["text"] for c in completions
    )
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    run = json.loads((out / "run.json").read_text())
    assert run["task_source"] == {"name": "numbers"} and run["task"] == "mymodule:make_tasks"
    assert run["rewards"] == ["env", "reward"]
    assert "done: 3 steps" in res.stderr and str(out) in res.stderr.splitlines()[-1]


def pytest_approx(x):
    import pytest

    return pytest.approx(x, abs=1e-6)
