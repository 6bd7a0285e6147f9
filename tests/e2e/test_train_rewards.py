"""TRL's own reward functions and an ms-swift-style ORM plugin train 3 steps through the launcher."""

from __future__ import annotations

import json

from support.launch import SMALL, metrics, torchrun


def _dataset(tmp_path):
    """Chat prompts (TRL: conversational completions) with a `solution` column."""
    data = tmp_path / "sums.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {i} + {i}? Box it."}], "solution": f"${2 * i}$"}
        for i in range(40)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


OVERLONG = """
from trl.rewards import get_soft_overlong_punishment

# every reply the tiny model samples (a token or more, then its end-of-turn token) is penalized
overlong = get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=3)


def sees_prompt(prompts, completions, solution, **kwargs):  # 1: the row's question is the prompt
    asked = [f"What is {int(s[1:-1]) // 2} + {int(s[1:-1]) // 2}? Box it." for s in solution]
    return [
        float(p == [{"role": "user", "content": q}] and c[-1]["role"] == "assistant")
        for p, c, q in zip(prompts, completions, asked)
    ]
"""


def test_trls_shipped_reward_functions_train(tmp_path):
    (tmp_path / "overlong.py").write_text(OVERLONG)
    out = tmp_path / "run"
    args = ["--dataset", str(_dataset(tmp_path)), "--no-env-reward"]
    args += ["--reward", "trl.rewards:accuracy_reward", "--reward", "trl.rewards:think_format_reward"]
    args += ["--reward", "overlong:overlong", "--reward", "overlong:sees_prompt"]
    args += ["--steps", "3", "--output-dir", str(out)]
    res = torchrun(*args, *SMALL, "--max-new-tokens", "8", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    names = ["accuracy_reward", "think_format_reward", "soft_overlong_punishment_reward"]
    for r in rows:
        assert all(isinstance(r[f"reward/{n}"], float) for n in names), r
        assert -1.0 <= r["reward/soft_overlong_punishment_reward"] < 0.0  # it read completion_ids
        assert r["reward/sees_prompt"] == 1.0  # every sample's prompts[i] is its row's prompt
    assert json.loads((out / "run.json").read_text())["rewards"] == [*names, "sees_prompt"]


PLUGIN = """
class ShortAnswer:  # ms-swift's ORM convention: built with no arguments, called on the texts
    def __call__(self, completions, solution, **kwargs):
        return [1.0 if len(c) <= 2 * len(s) else 0.0 for c, s in zip(completions, solution)]


class SeesQuestion:  # 1: `messages` is the whole conversation, the row's question first
    def __call__(self, completions, messages, solution, **kwargs):
        asked = [f"What is {int(s[1:-1]) // 2} + {int(s[1:-1]) // 2}? Box it." for s in solution]
        return [
            float(m[0] == {"role": "user", "content": q} and m[-1]["content"] == c)
            for m, c, q in zip(messages, completions, asked)
        ]


orms = {"myorm": ShortAnswer, "sees_question": SeesQuestion}
"""


def test_an_ms_swift_orm_plugin_trains_by_reward_funcs(tmp_path):
    (tmp_path / "myplugin.py").write_text(PLUGIN)
    out = tmp_path / "run"
    args = ["--dataset", str(_dataset(tmp_path)), "--no-env-reward", "--external-plugins", "myplugin.py"]
    args += ["--reward-funcs", "myorm", "accuracy", "sees_question", "--steps", "3", "--output-dir", str(out)]
    res = torchrun(*args, *SMALL, "--max-new-tokens", "8", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0.0 <= r["reward/myorm"] <= 1.0 and 0.0 <= r["reward/accuracy"] <= 1.0 for r in rows)
    assert all(r["reward/sees_question"] == 1.0 for r in rows)  # the question reached the ORM
    assert json.loads((out / "run.json").read_text())["rewards"] == ["myorm", "accuracy", "sees_question"]


def test_reward_functions_score_a_dataset_alone_without_no_env_reward(tmp_path):
    # TRL's way: a dataset and reward functions. Its rows bring no reward of their own, so the
    # start line says --no-env-reward came from the task, and the run trains
    out = tmp_path / "run"
    args = ["--dataset", str(_dataset(tmp_path)), "--reward-funcs", "format", "--steps", "2"]
    res = torchrun(*args, "--output-dir", str(out), *SMALL, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--no-env-reward True (a --dataset task, which has no reward of its own)" in res.stderr
    assert json.loads((out / "run.json").read_text())["rewards"] == ["format"]
    assert [r["step"] for r in metrics(out)] == [0, 1]
