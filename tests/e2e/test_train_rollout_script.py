"""launch/rollout.py: trajectories as JSONL, without training."""

from __future__ import annotations

import json

from support.launch import ROOT, SMALL, torchrun


def test_rollout_jsonl(tmp_path):
    out = tmp_path / "look"
    res = torchrun("--output-dir", str(out), "--steps", "1", *SMALL, script=ROOT / "launch" / "rollout.py")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 8  # two ranks, batch size 8 each
    assert len({r["conversation"] for r in rows}) == len(rows)
    for r in rows:
        assert len(r["token_ids"]) == len(r["loss_mask"])
        assert 0.0 <= r["reward"] <= 1.0
        assert r["seat"] == "policy" and r["messages"][0]["name"] == "policy"
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
        *SMALL,
        script=ROOT / "launch" / "rollout.py",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {r["seat"] for r in rows} == {"policy"}
    bad = torchrun(
        "--checkpoint",
        str(tmp_path / "none"),
        "--output-dir",
        str(tmp_path / "x"),
        script=ROOT / "launch" / "rollout.py",
    )
    assert bad.returncode != 0 and "--checkpoint" in bad.stderr and "no such folder" in bad.stderr


def test_an_environment_raising_on_one_rank_ends_both_named(tmp_path):
    from test_train_restarts import FAULTY

    (tmp_path / "faulty.py").write_text(FAULTY)
    out = tmp_path / "look"
    args = ["--task", "faulty:make", "--output-dir", str(out), "--steps", "5", *SMALL]
    res = torchrun(*args, script=ROOT / "launch" / "rollout.py", cwd=tmp_path, FAULT="raise")
    assert res.returncode == 1, res.stderr[-3000:]
    # both ranks name rank 1's environment (its conversations of step 3 raise), nothing written
    said = res.stderr.split("rollout.py: error: rank 1 failed: ")[1:]
    assert len(said) == 2 and all("ValueError: the environment broke" in s.splitlines()[0] for s in said)
    assert not (out / "rollouts.jsonl").exists()
