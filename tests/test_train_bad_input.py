"""Every bad input: one line on stderr, exit code 2, nothing written to the output folder."""

from __future__ import annotations

import json

import pytest
from train_utils import SMALL, python


def _refused(res, out, needle: str) -> None:
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert not out.exists() or not any(p.name != "run.json" for p in out.iterdir() if p.name != "keep")


def test_unknown_yaml_key(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("steps: 3\nlearning_rate: 0.1\n")
    out = tmp_path / "out"
    _refused(python("--config", str(cfg), "--output-dir", str(out)), out, "unknown key 'learning_rate'")
    assert not out.exists()


def test_yaml_value_of_the_wrong_type(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("steps: many\n")
    out = tmp_path / "out"
    _refused(python("--config", str(cfg), "--output-dir", str(out)), out, "steps must be int")


def test_cli_overrides_yaml(tmp_path):
    # the YAML asks for a bad TP; the command line fixes it, so the check passes that point
    cfg = tmp_path / "run.yaml"
    cfg.write_text("tp: 3\nnum_generations: 3\n")
    out = tmp_path / "out"
    res = python("--config", str(cfg), "--tp", "1", "--output-dir", str(out), WORLD_SIZE="1")
    _refused(res, out, "--num-generations 3 does not fit --batch-size 32")


def test_tp_not_dividing_world(tmp_path):
    out = tmp_path / "out"
    res = python("--tp", "2", "--output-dir", str(out), WORLD_SIZE="3")
    _refused(res, out, "--tp 2 does not divide the world size 3")


def test_tp_not_dividing_heads(tmp_path, tiny_path):
    out = tmp_path / "out"
    # the tiny model has 4 query heads and 2 key/value heads
    res = python("--tp", "4", "--model", str(tiny_path), "--output-dir", str(out), WORLD_SIZE="4")
    _refused(res, out, "--tp 4 does not divide num_key_value_heads=2")


def test_num_generations_not_fitting_batch(tmp_path):
    out = tmp_path / "out"
    res = python("--batch-size", "10", "--num-generations", "4", "--output-dir", str(out))
    _refused(res, out, "--num-generations 4 does not fit --batch-size 10")


def test_missing_model_folder(tmp_path):
    out = tmp_path / "out"
    res = python("--model", str(tmp_path / "nope"), "--output-dir", str(out))
    _refused(res, out, "not an HF checkpoint folder")


@pytest.mark.parametrize("flag", ["--lr=-1", "--is-mode=sideways", "--epsilon=2"])
def test_bad_loss_or_optimizer_knob(tmp_path, flag):
    out = tmp_path / "out"
    res = python(flag, "--output-dir", str(out))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not out.exists()


def test_output_dir_with_another_run(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"steps": 1}))
    _refused(python("--output-dir", str(out), *SMALL), out, "holds another run")
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]


def test_output_dir_with_foreign_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("mine")
    _refused(python("--output-dir", str(out)), out, "not a run of this script")
    assert sorted(p.name for p in out.iterdir()) == ["keep"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--step-timeout-s", "0"], "step_timeout_s must be a number of seconds > 0"),
        (["--on-timeout", "later"], "on_timeout must be one of ('zero', 'drop')"),
        (["--env", "chess"], "--env must be one of guess, duel"),
        (["--env", "duel", "--opponent", "mirror"], "--opponent must be one of self, random, frozen"),
    ],
)
def test_rollout_and_env_options(tmp_path, args, needle):
    out = tmp_path / "out"
    _refused(python(*args, "--output-dir", str(out)), out, needle)
