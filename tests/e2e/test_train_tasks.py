"""Real task libraries, datasets, tools and ms-swift schedulers through launch/train_grpo.py:
3 steps under torchrun on the tiny model, each writing its held-out `eval/success_rate`."""

from __future__ import annotations

import json

import pytest
from support.launch import SMALL, metrics, torchrun, trained

# `--model tiny`: the families bring SmolLM2 by default (cli/defaults.py); these runs check
# the plumbing of each library, quickly, on the tiny policy
TASKS = [
    ["--task", "reasoning_gym:basic_arithmetic", "--model", "tiny"],
    ["--task", "gym:FrozenLake-v1", "--task-args", '{"max_steps": 3}', "--model", "tiny"],
    ["--task", "textarena:TicTacToe-v0", "--task-args", '{"max_moves": 3}', "--model", "tiny"],  # self-play
]


@pytest.mark.parametrize("args", TASKS, ids=lambda a: a[1])
def test_task_library_trains(tmp_path, args):
    out = tmp_path / "run"
    res = torchrun(*args, "--steps", "3", "--output-dir", str(out), *SMALL, "--max-new-tokens", "8")
    assert res.returncode == 0, res.stderr[-3000:]
    # the family's own options, where the command line left them: each named with its origin
    assert f"--lr 1e-05 (task {args[1]})" in res.stderr and "--model tiny (command line)" in res.stderr
    rows = trained(out)
    if "textarena" in args[1]:  # both seats train, each its own mean
        assert all("reward_mean/player_0" in r and "reward_mean/player_1" in r for r in rows)


REWARD = """
def exact(trajectories, rows):
    said = [t.infos["completion"].strip() for t in trajectories]
    return [float(s == str(row.columns["answer"])) for s, row in zip(said, rows)]
"""


def test_dataset_with_a_reward_function_and_tools(tmp_path):
    data = tmp_path / "sums.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"what is {i} + {i}?", "answer": 2 * i}) + "\n" for i in range(40))
    )
    (tmp_path / "myreward.py").write_text(REWARD)
    out = tmp_path / "run"
    args = ["--dataset", str(data), "--reward", "myreward:exact", "--no-env-reward"]
    args += ["--tools", "interlens_mcore.tools.examples:calculator", "--steps", "3", "--output-dir", str(out)]
    res = torchrun(*args, *SMALL, "--max-new-tokens", "8", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    trained(out)
    run = json.loads((out / "run.json").read_text())
    assert run["rewards"] == ["exact"] and run["task_source"]["tools"] == ["calculator"]


SCHEDULER = """
from interlens_mcore.compat.swift import MultiTurnScheduler  # the one changed line


class Tips(MultiTurnScheduler):
    async def on_turn_end(self, infer_request, response_choice, current_turn):
        right = response_choice.message.content.strip() == str(infer_request.data_dict["answer"])
        infos = {"reward": float(right), "success": float(right)}
        return {"done": right or current_turn >= 2, "rollout_infos": infos}

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "not quite, try again"})
        return {"infer_request": infer_request}
"""


def test_ms_swift_scheduler_from_the_command_line(tmp_path):
    data = tmp_path / "rows.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{i} + 1 = ?"}], "answer": i + 1} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "plugin.py").write_text(SCHEDULER)
    out = tmp_path / "run"
    args = [
        "--external-plugins",
        "plugin.py",
        "--multi-turn-scheduler",
        "plugin:Tips",
        "--dataset",
        str(data),
    ]
    args += ["--eval-dataset", str(data), "--steps", "3", "--output-dir", str(out)]
    res = torchrun(*args, *SMALL, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(1.0 <= r["turns_mean"] <= 2.0 for r in rows)
