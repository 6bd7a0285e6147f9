"""`--task verifiers:ENV` through launch/train_grpo.py: 3 steps under torchrun (2 gloo ranks) on
a SingleTurnEnv and a ToolEnv built in a file from verifiers' public API, each writing its
held-out `eval/success_rate`, the rewards the rubric's."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest
from support.launch import ROOT, SMALL, TRAIN, env, kill_all, metrics, python, torchrun, trained
from support.verifiers_envs import write

# the whole reply of the tiny model's chat template: what the rubric scored
_REPLY = re.compile(r"<\|im_start\|>assistant\n(.*?)(?:<\|im_end\|>|$)", re.S)


def _train(tmp_path, spec: str, *extra: str):
    out = tmp_path / "run"
    args = ["--task", spec, "--model", "tiny", "--steps", "3", "--output-dir", str(out), *SMALL]
    args += ["--max-new-tokens", "4", "--log-completions-every", "1", *extra]
    res = torchrun(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = trained(out)
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    return rows, completions, json.loads((out / "run.json").read_text())


def _digit_reward(text: str, asked: str) -> float:
    """The SingleTurnEnv's rubric (support/verifiers_envs.py) worked out from the logged text."""
    reply = _REPLY.findall(text)[-1].strip()
    return float(reply == asked) + 0.5 * float(reply[:1].isdigit())


def test_single_turn_env_trains_on_its_rubric(tmp_path):
    envs = write(tmp_path)
    rows, completions, run = _train(tmp_path, f"verifiers:{envs.name}", "--log-completions", "32")
    assert all(0.0 <= r["reward_mean"] <= 1.5 for r in rows)
    # every trajectory rank 0 trained (8 a step; --log-completions asks for more)
    assert len(completions) == 3 * 8 and {c["step"] for c in completions} == {0, 1, 2}
    for c in completions:  # each logged reward is what the rubric gives the logged reply
        asked = re.search(r"say the digit (\d)", c["text"]).group(1)
        assert c["reward"] == _digit_reward(c["text"], asked), c
    assert run["task_source"]["name"] == f"verifiers:{envs.name}"
    assert run["task_source"]["rows"]["eval_from"] == "held-out dataset rows"


def test_tool_env_trains_with_its_tool(tmp_path):
    envs = write(tmp_path)
    rows, completions, run = _train(tmp_path, f"verifiers:{envs.name}:tool_env", "--task-arg", "max_turns=2")
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    # the endpoint presents the environment's tool to the policy in the prompt
    assert all('"add"' in c["text"] for c in completions)
    assert run["task_source"]["rows"]["eval_from"] == "eval_dataset"


def test_flags_that_do_not_reach_the_environment_are_refused(tmp_path):
    envs = write(tmp_path)
    res = python("--task", f"verifiers:{envs}", "--tools", "interlens_mcore.tools.examples:calculator")
    assert res.returncode == 2
    refusal = f"--task verifiers:{envs} runs the environment's own rollouts: --tools does not reach it"
    assert refusal in res.stderr
    res = python("--task", f"verifiers:{envs}", "--agent", "launch/agents/guess_agent.py:play")
    assert res.returncode == 2 and "--agent would replace them" in res.stderr


@pytest.mark.slow  # Ctrl-C to a real torchrun: the slow stage
def test_ctrl_c_still_saves_the_step(tmp_path):
    # verifiers installs its own SIGINT handler (teardown, then KeyboardInterrupt) when the
    # environment is built; the trainer's, which finishes the step and saves it, must be the one
    envs = write(tmp_path)
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "--standalone", "--nproc_per_node=2", str(TRAIN)]
    cmd += ["--task", f"verifiers:{envs}", "--model", "tiny", "--output-dir", str(out), *SMALL]
    cmd += ["--steps", "30", "--save-every", "50"]
    proc = subprocess.Popen(
        cmd, env=env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while _lines(out / "metrics.jsonl") < 2:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "fewer than 2 steps within 240 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            kill_all(proc)
    assert proc.returncode == 0, err[-3000:]
    stopped_at = len(metrics(out))
    assert 2 <= stopped_at < 30 and (out / "checkpoints" / f"step-{stopped_at:06d}").is_dir()
    assert (
        err.strip().splitlines()[-1].startswith(f"train_grpo.py: stopped by SIGINT after step {stopped_at}")
    )


def _lines(path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0
