"""The rollout soak: a short torchrun soak on 2 ranks ends clean, and its checks do catch a
trajectory that differs from what the engine saw."""

from __future__ import annotations

import copy
import importlib
import json
import sys
from collections import Counter

import pytest
from support.launch import ROOT, torchrun

SCRIPT = ROOT / "benchmarks" / "soak_rollout.py"


def test_short_soak_on_two_ranks(tiny_path):
    # seed 5, 10 runs: each driver raises one injected failure (an environment's respond, a
    # scheduler's hook) and runs one step past the time limit; found by running seeds 0-8.
    # The soak takes ~2 s, the rest is torchrun start-up.
    args = ["--runs", "10", "--seed", "5", "--model", str(tiny_path), "--json"]
    proc = torchrun(*args, script=SCRIPT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["runs"] == 10 and out["ranks"] == 2 and out["seed"] == 5
    assert out["hangs"] == 0 and out["unexpected_errors"] == 0, proc.stderr[-3000:]
    assert out["injected_failures"] == 2 and out["surfaced_failures"] == 2
    for driver in out["drivers"].values():
        assert driver["runs"] == 5 and driver["failures"] >= 1 and driver["timeouts"] >= 1
    assert out["trajectories"] > 0
    assert out["misaligned_trajectories"] == 0 and out["lost_trajectories"] == 0, proc.stderr[-3000:]
    assert out["missed_timeouts"] == 0 and out["bad_status"] == 0
    assert "soak: run 10/10" in proc.stderr  # progress goes to stderr, never to the JSON line


@pytest.fixture(scope="module")
def soak():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module("soak_checks")


@pytest.fixture(scope="module")
def rolled(soak, tiny):
    """One co_step conversation (3 policy turns) on the tiny model, recorded."""
    from interlens_mcore import (
        Conversation,
        HFEngine,
        MaxTurns,
        Message,
        Policy,
        SamplingParams,
        Scripted,
        co_step,
    )

    model, tok = tiny
    engine = soak.Recorder(HFEngine(model, tok))
    commits = Counter()

    def count(conv, msg):
        commits[msg.speaker] += 1
        return msg

    policy = Policy("policy", engine, tok, SamplingParams(max_new_tokens=4))
    conv = Conversation(
        [policy, Scripted("env", ["higher", "lower"])],
        [Message(speaker="user", content="guess the number")],
        run_until=MaxTurns(5),
        hooks=[count],
        id="c0",
    )
    co_step([conv], turns=None)
    return conv, engine.calls["c0"], commits


def test_checks_pass_on_an_untouched_rollout(soak, rolled):
    conv, calls, commits = rolled
    traj = conv.trajectories()[0]
    assert len(calls) == 3 and commits == {"policy": 3, "env": 2}
    assert soak.check_conversation(conv, traj, calls, commits) == []
    assert soak.check_batch([traj]) == []


def _tampered(traj, how: str):
    bad = copy.deepcopy(traj)
    s = bad.turns[1].end - 1  # the last sampled id of turn 2
    if how == "token":
        bad.token_ids[s] = (bad.token_ids[s] + 1) % 100
    elif how == "mask":  # one position early: the template's closing id trained, a sampled one not
        bad.loss_mask = bad.loss_mask[1:] + [0]
    elif how == "logprobs":
        bad.rollout_logprobs = bad.rollout_logprobs[::-1]
    elif how == "prompt":  # an environment message token that the engine did not see
        bad.token_ids[bad.turns[1].start - 2] += 1
    return bad


@pytest.mark.parametrize(
    "how, expected",
    [
        ("token", "turn 2: trained ids"),
        ("mask", "loss mask"),
        ("logprobs", "rollout logprobs"),
        ("prompt", "turn 2: trajectory prefix"),
    ],
)
def test_checks_catch_a_tampered_trajectory(soak, rolled, how, expected):
    conv, calls, commits = rolled
    problems = soak.check_conversation(conv, _tampered(conv.trajectories()[0], how), calls, commits)
    assert any(expected in p for p in problems), problems


def test_checks_catch_a_lost_turn_and_a_shifted_batch(soak, rolled, monkeypatch):
    conv, calls, commits = rolled
    traj = conv.trajectories()[0]
    extra = calls + [calls[-1]]  # the engine answered a fourth time; the trajectory kept three turns
    assert any(
        "3 trained turns, 4 engine calls" in p for p in soak.check_conversation(conv, traj, extra, commits)
    )

    real = soak.build_batch

    def shifted(*args, **kwargs):  # old logprobs one position late, as an off-by-one would put them
        batch = real(*args, **kwargs)
        batch.rollout_logprobs = batch.rollout_logprobs.roll(1, dims=1)
        return batch

    monkeypatch.setattr(soak, "build_batch", shifted)
    assert any("old logprobs" in p for p in soak.check_batch([traj]))
