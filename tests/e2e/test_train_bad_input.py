"""Every bad input: one line on stderr, exit code 2, nothing written to the output folder.

Most cases call `launch/train_grpo.py`'s `main` in this process (every check runs before any
process group exists, so that is the code path of a real launch); a few run the script as a
user would, to show the one line and the exit code end to end.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from support.launch import SMALL, python


@pytest.fixture
def run(capsys, monkeypatch):
    """`main(args)` in this process, with WORLD_SIZE and friends as given; returns exit code and stderr."""
    from support.launch import train_main

    def call(*args: str, **env: str) -> subprocess.CompletedProcess:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        code = train_main()(list(args))
        return subprocess.CompletedProcess(args, code, "", capsys.readouterr().err)

    return call


def _refused(res, out, needle: str) -> None:
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert not out.exists() or not any(p.name != "run.json" for p in out.iterdir() if p.name != "keep")


def test_unknown_yaml_key(tmp_path):  # end to end: the script as a user runs it
    cfg = tmp_path / "run.yaml"
    cfg.write_text("steps: 3\nlearnin_rate: 0.1\n")  # `learning_rate`, TRL's name, is an alias of lr
    out = tmp_path / "out"
    _refused(python("--config", str(cfg), "--output-dir", str(out)), out, "unknown key 'learnin_rate'")
    assert not out.exists()


def test_yaml_value_of_the_wrong_type(run, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("steps: many\n")
    out = tmp_path / "out"
    _refused(run("--config", str(cfg), "--output-dir", str(out)), out, "steps must be int")


def test_cli_overrides_yaml(run, tmp_path):
    # the YAML asks for a bad TP; the command line fixes it, so the check passes that point
    cfg = tmp_path / "run.yaml"
    cfg.write_text("tp: 3\nnum_generations: 3\n")
    out = tmp_path / "out"
    res = run("--config", str(cfg), "--tp", "1", "--output-dir", str(out), WORLD_SIZE="1")
    _refused(res, out, "--num-generations 3 does not fit --batch-size 64")


def test_tp_not_dividing_world(run, tmp_path):
    out = tmp_path / "out"
    res = run("--tp", "2", "--output-dir", str(out), WORLD_SIZE="3")
    _refused(res, out, "--tp 2 does not divide the world size 3")


def test_tp_not_dividing_heads(run, tmp_path, tiny_path):
    out = tmp_path / "out"
    # the tiny model has 4 query heads and 2 key/value heads
    res = run("--tp", "4", "--model", str(tiny_path), "--output-dir", str(out), WORLD_SIZE="4")
    _refused(res, out, "--tp 4 does not divide num_key_value_heads=2")


def test_num_generations_not_fitting_batch(run, tmp_path):
    out = tmp_path / "out"
    res = run("--batch-size", "10", "--num-generations", "4", "--output-dir", str(out))
    _refused(res, out, "--num-generations 4 does not fit --batch-size 10")


def test_missing_model_folder(run, tmp_path):
    out = tmp_path / "out"
    res = run("--model", str(tmp_path / "nope"), "--output-dir", str(out))
    _refused(res, out, "not an HF checkpoint folder")


@pytest.mark.parametrize("flag", ["--lr=-1", "--is-mode=sideways", "--epsilon=2"])
def test_bad_loss_or_optimizer_knob(run, tmp_path, flag):
    out = tmp_path / "out"
    res = run(flag, "--output-dir", str(out))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not out.exists()


def test_bf16_on_the_deepspeed_backend(run, tmp_path):
    out = tmp_path / "out"
    res = run("--backend", "deepspeed", "--bf16", "true", "--output-dir", str(out))
    _refused(res, out, "--bf16 is for the megatron backend")


def test_output_dir_with_another_run(run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"steps": 1}))
    _refused(run("--output-dir", str(out), *SMALL), out, "holds another run")
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]


def test_output_dir_with_foreign_files(run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("mine")
    _refused(run("--output-dir", str(out)), out, "not a run of this trainer")
    assert sorted(p.name for p in out.iterdir()) == ["keep"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--step-timeout-s", "0"], "--step-timeout-s must be a number of seconds > 0"),
        (["--on-timeout", "later"], "--on-timeout: invalid choice: 'later' (choose from 'zero', 'drop')"),
        (["--task", "chess"], "--task 'chess' is not a known task; expected one of guess, duel"),
        (
            ["--task", "duel", "--task-args", '{"opponent": "mirror"}'],
            "opponent must be one of self, random, frozen",
        ),
        (["--task", "guess", "--task-args", '{"opponent": "random"}'], "--task guess: bad --task-args"),
        (["--task-args", "[1, 2]"], "--task-args must be a JSON object"),
        (["--task", "nosuchmodule:make"], "--task: cannot import 'nosuchmodule'"),
        (["--reward", "json:nope"], "--reward 'json:nope': json has no 'nope'"),
        (["--reward-weights", "1", "2"], "--reward-weights has 2 values for 1 reward functions (env)"),
    ],
)
def test_rollout_task_and_reward_options(run, tmp_path, args, needle):
    out = tmp_path / "out"
    _refused(run(*args, "--output-dir", str(out)), out, needle)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--lrr", "0.1"], "unrecognized arguments: --lrr (did you mean --lr?)"),
        (["--num-generation", "4"], "(did you mean --num-generations?)"),
    ],
)
def test_mistyped_flag_suggests_the_closest(tmp_path, args, needle):
    out = tmp_path / "out"
    _refused(python(*args, "--output-dir", str(out)), out, needle)


def test_mistyped_yaml_key_suggests_the_closest(run, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("stpes: 3\n")
    out = tmp_path / "out"
    _refused(
        run("--config", str(cfg), "--output-dir", str(out)), out, "unknown key 'stpes' (did you mean steps?)"
    )


def test_help_lists_every_option_with_its_default():
    res = python("--help")
    assert res.returncode == 0
    text = " ".join(res.stdout.split())
    for needle in (
        "--lr LR AdamW learning rate (the peak, with a schedule) (alias: --learning-rate) (default: 0.001)",
        "--task TASK",
        "{megatron,deepspeed}",
        "--report_to REPORT_TO",
        "(default: 600)",
    ):
        assert needle in text, needle


def test_engine_vllm_without_vllm(run, tmp_path, monkeypatch):
    import sys

    # vLLM absent (as in the main environment) or unimportable: a None module makes import fail
    monkeypatch.setitem(sys.modules, "vllm", None)
    out = tmp_path / "out"
    res = run("--engine", "vllm", "--output-dir", str(out))
    _refused(res, out, "--engine vllm: vLLM does not import here")
    assert res.stderr.strip().endswith(
        '; on a GPU install it with pip install -e ".[all,vllm]", on CPU run in the environment '
        ".ci/vllm_stage.sh builds"
    )


def test_vllm_sleep_without_vllm_engine(run, tmp_path):
    out = tmp_path / "out"
    res = run("--vllm-sleep", "--output-dir", str(out))
    _refused(res, out, "--vllm-sleep puts vLLM to sleep during training: it needs --engine vllm")
