"""launch/rollout.py: trajectories as JSONL, without training."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from support.launch import ROOT, SMALL, env, kill_all, torchrun

ROLLOUT = ROOT / "launch" / "rollout.py"
LOOK = SMALL[: SMALL.index("--save-every")]  # SMALL's rollout options (the rest are training ones)
# a run that differs from the defaults in its task and sampling: self-play duel, 3-token turns
DUEL = ["--task", "duel", "--batch-size", "4", "--num-generations", "2", "--max-new-tokens", "3"]
DUEL += ["--eval-size", "2", "--save-every", "2"]


@pytest.fixture(scope="module")
def duel_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("duel") / "run"
    res = torchrun("--output-dir", str(run), "--steps", "2", *DUEL)
    assert res.returncode == 0, res.stderr[-3000:]
    return run


def rollout_here(*args: str) -> subprocess.CompletedProcess:
    """`python launch/rollout.py ARGS` (the checks that end before any process group)."""
    cmd = [sys.executable, str(ROLLOUT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env(), cwd=ROOT)


def test_a_checkpoint_is_rolled_out_on_its_own_task_once_by_default(duel_run, tmp_path):
    out = tmp_path / "look"
    res = torchrun("--checkpoint", str(duel_run), "--output-dir", str(out), script=ROLLOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    # the run's task (two trained seats), batch size and turn cap; one round, not 600
    assert {r["seat"] for r in rows} == {"player_a", "player_b"}
    assert len(rows) == 2 * 4 * 2 and {r["step"] for r in rows} == {0}  # ranks x batch x seats
    assert all(len(turn["token_ids"]) <= 3 for r in rows for turn in r["turns"])
    said = [line for line in res.stderr.splitlines() if line.startswith("rollout.py: ")]
    assert said and "1 round(s) (the default; --steps N for more) of --task duel" in said[0]
    assert str(duel_run / "run.json") in said[0]
    assert "rollout: 100%" in res.stderr and "1/1" in res.stderr  # the progress line


def test_the_command_line_overrides_the_run(duel_run, tmp_path):
    out = tmp_path / "look"
    args = ["--checkpoint", str(duel_run), "--output-dir", str(out), "--steps", "2", "--task", "guess"]
    res = torchrun(*args, "--max-new-tokens", "2", script=ROLLOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert {r["seat"] for r in rows} == {"policy"} and {r["step"] for r in rows} == {0, 1}
    assert len(rows) == 2 * 2 * 4 and all(len(t["token_ids"]) <= 2 for r in rows for t in r["turns"])


def test_options_the_checkpoint_cannot_load_under_are_refused(duel_run, tmp_path):
    res = rollout_here("--checkpoint", str(duel_run), "--backend", "deepspeed", "--output-dir", str(tmp_path))
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("rollout.py: error: --backend deepspeed: checkpoint ")
    assert "trained with --backend megatron" in line


def test_its_own_short_help_and_training_options_refused():
    res = rollout_here("--help")
    assert res.returncode == 0, res.stderr[-3000:]
    # option names: every spelling on an option's own line (before its description); descriptions
    # may name other flags (--tp's "may change on --resume") and do not list them
    heads = [line.strip().split("  ")[0] for line in res.stdout.splitlines() if line.startswith("  -")]
    listed = {name for head in heads for name in re.findall(r"(?:^|, )(--[\w-]+)", head)}
    assert {"--checkpoint", "--steps", "--task", "--max-new-tokens", "--temperature"} <= listed
    assert not {"--lr", "--beta", "--save-every", "--eval-every", "--resume", "--export-hf"} & listed
    assert "optimizer steps" not in res.stdout and "rollout rounds" in res.stdout
    res = rollout_here("--lr", "0.1", "--save-every=2", *LOOK)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "rollout.py: error: --lr, --save-every: training options; rollout.py does not train "
        "(launch/rollout.py --help lists its options)"
    ]


def test_rollout_jsonl(tmp_path):
    out = tmp_path / "look"
    res = torchrun("--output-dir", str(out), "--steps", "1", *LOOK, script=ROLLOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 8  # two ranks, batch size 8 each
    assert len({r["conversation"] for r in rows}) == len(rows)
    for r in rows:
        assert len(r["token_ids"]) == len(r["loss_mask"])
        assert 0.0 <= r["reward"] <= 1.0
        assert r["seat"] == "policy"
        # the transcript opens with the row's prompt (as reward functions see it), then the seat's turns
        assert r["messages"][0]["role"] == "user"
        assert [m["role"] for m in r["messages"] if m["name"] == "policy"][:1] == ["assistant"]
        trained = [t for t, m in zip(r["token_ids"], r["loss_mask"]) if m]
        assert [i for turn in r["turns"] for i in turn["token_ids"]] == trained
        for turn in r["turns"]:
            assert len(turn["logprobs"]) == len(turn["token_ids"]) and all(lp <= 0 for lp in turn["logprobs"])


def test_rollout_from_a_training_checkpoint(tmp_path):
    run, out = tmp_path / "run", tmp_path / "look"
    assert torchrun("--output-dir", str(run), "--steps", "2", *SMALL).returncode == 0
    res = torchrun(
        "--checkpoint",
        str(run),
        "--output-dir",
        str(out),
        "--steps",
        "1",
        *LOOK,
        script=ROLLOUT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {r["seat"] for r in rows} == {"policy"}
    bad = torchrun(
        "--checkpoint",
        str(tmp_path / "none"),
        "--output-dir",
        str(tmp_path / "x"),
        script=ROLLOUT,
    )
    assert bad.returncode != 0 and "--checkpoint" in bad.stderr and "no such folder" in bad.stderr


def test_an_environment_raising_on_one_rank_ends_both_named(tmp_path):
    from test_train_restarts import FAULTY

    (tmp_path / "faulty.py").write_text(FAULTY)
    out = tmp_path / "look"
    args = ["--task", "faulty:make", "--output-dir", str(out), "--steps", "5", *LOOK]
    args += ["--on-sample-error", "raise"]  # by default the error would end only its samples
    res = torchrun(*args, script=ROLLOUT, cwd=tmp_path, FAULT="raise")
    assert res.returncode == 1, res.stderr[-3000:]
    # both ranks name rank 1's environment (its conversations of step 3 raise)
    said = res.stderr.split("rollout.py: error: rank 1 failed: ")[1:]
    assert len(said) == 2 and all("ValueError: the environment broke" in s.splitlines()[0] for s in said)
    # written as it went: the rounds before the failure are there, whole
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [s for s in (0, 1, 2) for _ in range(2 * 8)]


def test_a_killed_rollout_keeps_the_rounds_it_wrote(tmp_path):
    out, err = tmp_path / "look", tmp_path / "stderr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROLLOUT)]
    cmd += ["--output-dir", str(out), "--steps", "500", *LOOK]
    path, deadline = out / "rollouts.jsonl", time.monotonic() + 240
    with err.open("w") as stderr:
        proc = subprocess.Popen(cmd, env=env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            while not (path.is_file() and path.read_text().count("\n") >= 2 * 16):
                assert proc.poll() is None, err.read_text()[-3000:]
                assert time.monotonic() < deadline, "no two rounds written within 240 s"
                time.sleep(0.2)
        finally:
            kill_all(proc)  # SIGKILL, mid-way through the 500 rounds
    text = path.read_text()
    rows = [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]  # whole lines
    assert [r["step"] for r in rows][: 2 * 16] == [s for s in (0, 1) for _ in range(16)]  # whole rounds
