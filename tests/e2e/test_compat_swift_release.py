"""ms-swift's own `multi_turn.py` (the 4.6.0 release file, import lines changed only) trains
each of its four schedulers by registry name through `--multi-turn-scheduler`, 3 steps on 2
ranks under torchrun; GYMScheduler plays an environment of ours named by `--gym-env`.

The release files come from ms-swift's wheel at test time (support/swift_release.py).
OpenEnvScheduler's own `openenv_wrapper.py` talks to an OpenEnv server over WebSocket through
the `openenv` package (neither is here): the plugin folder holds a stand-in of that one file,
an in-process environment with the wrapper's synchronous reset / step / close.
"""

from __future__ import annotations

import json

import pytest
from support.launch import SMALL, evaluations, metrics, torchrun
from support.swift_release import release_files

# four 3-step torchrun runs (about four minutes here), and a download on a fresh machine
pytestmark = pytest.mark.slow

# an environment of ours, registered ms-swift style in the plugin file's own `envs`
ENVS = """
from interlens_mcore.compat.swift import Env, MathAccuracy


class TinyMathEnv(Env):
    async def reset(self, config):
        self.solution = config.data_dict["solution"]
        return config.data_dict["problem"], {}, "Answer with the number only."

    async def step(self, action):
        right = MathAccuracy()([action[-1]["content"]], [self.solution])[0]
        return "Not quite, try again.", right, right == 1.0, {}

    async def close(self):
        pass


envs = {"math_env": TinyMathEnv}
"""

# stands in for ms-swift's openenv_wrapper.py (a WebSocket client of an OpenEnv server)
OPENENV_WRAPPER = """
class OpenEnvWrapper:
    def __init__(self, env_config):
        self.env_config, self.moves = env_config, 0

    def reset(self):
        return {"question": "Say a number."}, {}

    def step(self, action):
        self.moves += 1
        return {"question": "Another one."}, float(len(action["message"]) % 2), self.moves >= 2, {}

    def close(self):
        pass
"""

REWARD = """
def short(trajectories, rows):
    return [1.0 / (1 + len(t.infos["completion"])) for t in trajectories]
"""

# name -> options beyond the common ones: MathTips and ThinkingTips set no reward of their own,
# so the reward function given is the reward (no --no-env-reward, as in ms-swift and TRL)
OUR_REWARD = ["--reward", "reward.py:short"]
RUNS = {
    "math_tip_trick": OUR_REWARD,
    "thinking_tips_scheduler": [*OUR_REWARD, "--loss-scale", "last_round"],
    "gym_scheduler": ["--gym-env", "math_env", "--reward-key", "total_reward", "--loss-scale", "last_round"],
    "openenv_scheduler": ["--reward-key", "total_reward"],
}


# name -> (its class in the release file, text only that scheduler or environment writes)
WHAT_RAN = {
    "math_tip_trick": ("MathTipsScheduler", "But wait... It seems I made a mistake,"),
    "thinking_tips_scheduler": ("ThinkingModelTipsScheduler", "The answer is not correct"),
    "gym_scheduler": ("GYMScheduler", "Answer with the number only."),  # TinyMathEnv's system
    "openenv_scheduler": ("OpenEnvScheduler", '{"question": "Say a number."}'),
}


@pytest.fixture(scope="module")
def plugin_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("swift_release")
    release_files(folder)
    (folder / "tiny_envs.py").write_text(ENVS)
    (folder / "openenv_wrapper.py").write_text(OPENENV_WRAPPER)
    (folder / "reward.py").write_text(REWARD)
    rows = [
        {"messages": [{"role": "user", "content": f"What is {i} + 1?"}], "problem": f"What is {i} + 1?",
         "solution": str(i + 1), "env_config": {}}
        for i in range(16)
    ]  # fmt: skip
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.mark.parametrize("name", list(RUNS))
def test_release_scheduler_trains_by_registry_name(plugin_folder, tmp_path, name):
    out = tmp_path / "run"
    args = ["--external-plugins", "multi_turn.py", "tiny_envs.py", "--multi-turn-scheduler", name]
    args += ["--dataset", "rows.jsonl", "--eval-dataset", "rows.jsonl", "--max-turns", "2"]
    args += [*RUNS[name], "--steps", "3", "--output-dir", str(out), *SMALL]
    res = torchrun(*args, cwd=plugin_folder, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(1.0 <= r["turns_mean"] <= 2.0 for r in rows)
    run = json.loads((out / "run.json").read_text())
    scheduler, said = WHAT_RAN[name]
    assert run["task_source"]["scheduler"] == scheduler  # the release file's class, by its name
    texts = [json.loads(line)["text"] for line in (out / "completions.jsonl").read_text().splitlines()]
    assert any(said in t for t in texts)  # the scheduler's own logic (or our environment) spoke
    # the held-out rows report as every source's do, before training and after it
    evals = [r for r in evaluations(out) if "eval/success_rate" in r]
    assert [r["step"] for r in evals] == [0, 3]
    for r in evals:
        assert 0.0 <= r["eval/success_low"] <= r["eval/success_rate"] <= r["eval/success_high"] <= 1.0
        assert r["eval/success_n"] == 8 and isinstance(r["eval/reward"], float)  # 4 rows per rank
