"""The reporters and the reward checks, in one process: the same keys in jsonl, tensorboard and
wandb (offline), completions, the summary line, and reward functions that return the wrong thing."""

from __future__ import annotations

import json

import pytest

from interlens_mcore.grpo.rewards import RewardError, WeightedRewards, environment_reward
from interlens_mcore.types import Trajectory
from trainers.report.reporter import Reporter, current, read_jsonl


def _records(n: int) -> list[dict]:
    # reward rises 0.1 per step; evaluation at steps 0 and n
    out = [{"step": s, "reward_mean": 0.1 * s, "reward_std": 0.0, "kl": 0.01, "loss": 1.0} for s in range(n)]
    out[0]["eval/success_rate"] = 0.25
    return out + [{"step": n, "eval/success_rate": 0.75}]


def test_every_logger_gets_the_same_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    report = Reporter(tmp_path, reporters=["jsonl", "tensorboard", "wandb"], total=10, start=0, enabled=True)
    for r in _records(10):
        report.log(r)
    sample = {"conversation": "c", "seat": "policy", "reward": 1.0, "advantage": 0.5, "text": "a | b"}
    report.completions(0, [sample])
    line = report.close(steps=10)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(11))
    assert json.loads((tmp_path / "completions.jsonl").read_text())["text"] == "a | b"
    assert (tmp_path / "reward.png").stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert {"reward_mean", "kl", "eval/success_rate"} <= set(events.Tags()["scalars"])
    assert len(events.Scalars("reward_mean")) == 10
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    # first / last 10 % of 10 steps: one step each, 0.0 and 0.9
    assert (
        "reward_mean first/last 10 %: 0.000 -> 0.900" in line and "eval/success_rate: 0.250 -> 0.750" in line
    )


def test_resume_marks_steps_past_the_checkpoint_and_keeps_every_line(tmp_path):
    report = Reporter(tmp_path, reporters=["jsonl"], total=10, start=0, enabled=True)
    for r in _records(6)[:6]:
        report.log(r)
    report.completions(5, [{"seat": "policy", "reward": 1.0, "advantage": 0.0, "text": "t"}])
    report.close(steps=6, failed=True)
    before = (tmp_path / "metrics.jsonl").read_text().splitlines()
    Reporter(tmp_path, reporters=["jsonl"], total=10, start=4, enabled=True).close(steps=4, failed=True)
    after = read_jsonl(tmp_path / "metrics.jsonl")
    unmarked = [{k: v for k, v in r.items() if k != "superseded"} for r in after]
    assert unmarked == [json.loads(x) for x in before]
    assert [r["step"] for r in after if r.get("superseded")] == [4, 5]
    assert [r["step"] for r in current(after)] == [0, 1, 2, 3]
    assert [r.get("superseded") for r in read_jsonl(tmp_path / "completions.jsonl")] == [True]


def test_a_finished_runs_last_evaluation_stays_current_when_extended(tmp_path):
    report = Reporter(tmp_path, reporters=["jsonl"], total=2, start=0, enabled=True)
    for r in _records(2):  # steps 0 and 1, then the end-of-run evaluation of step 2
        report.log(r)
    report.close(steps=2)
    before = read_jsonl(tmp_path / "metrics.jsonl")
    extended = Reporter(tmp_path, reporters=["jsonl"], total=4, start=2, enabled=True)
    extended.log({"step": 2, "reward_mean": 0.5})
    line = extended.close(steps=3)
    after = read_jsonl(tmp_path / "metrics.jsonl")
    assert after[: len(before)] == before and after[-1] == {"step": 2, "reward_mean": 0.5}
    assert line is not None and "eval/success_rate: 0.250 -> 0.750" in line


def _traj(i: int, reward: float | None = 0.5) -> Trajectory:
    return Trajectory(
        token_ids=[1, 2],
        loss_mask=[0, 1],
        rollout_logprobs=None,
        infos={"conversation": f"c{i}", "env_reward": reward},
    )


@pytest.mark.parametrize(
    "returned, needle",
    [
        ("nope", "reward function 'bad' returned str, expected a list of floats"),
        ([1.0], "reward function 'bad' returned 1 values for 2 trajectories"),
        (
            [1.0, "x"],
            "reward function 'bad' returned 'x' for trajectory 1 (c1, seat 'policy'), expected a finite",
        ),
        ([1.0, float("nan")], "returned nan for trajectory 1 (c1, seat 'policy')"),
        ([True, 1.0], "returned True for trajectory 0"),
    ],
)
def test_a_reward_function_returning_the_wrong_thing_is_named(returned, needle):
    def bad(trajectories, rows):
        return returned

    with pytest.raises(RewardError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        WeightedRewards([environment_reward, bad])([_traj(0), _traj(1)], [None, None])


def test_weights_combine_and_each_part_is_kept():
    def twice(trajectories, rows):
        return [2.0 for _ in trajectories]

    totals, parts = WeightedRewards([environment_reward, twice], [1.0, 0.25]).score(
        [_traj(0), _traj(1)], [0, 1]
    )
    assert totals == [0.5 + 0.5, 0.5 + 0.5] and parts == {"env": [0.5, 0.5], "twice": [2.0, 2.0]}
    with pytest.raises(RewardError, match="has no environment reward"):
        environment_reward([_traj(0, reward=None)], [None])


def test_wilson_interval_and_the_summary_that_shows_it(tmp_path):
    from trainers.report.record import wilson_interval
    from trainers.report.reporter import summary

    # textbook values: 50 of 100 -> [0.404, 0.596]; 0 of 10 -> [0, 0.278]; 10 of 10 -> [0.722, 1]
    assert wilson_interval(0.5, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    assert wilson_interval(0.0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(1.0, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson_interval(0.3, 0) == (0.0, 1.0)  # no trials, no knowledge
    # the interval holds the rate exactly where rounding would put its bound past it
    assert [wilson_interval(0.0, n)[0] for n in (3, 5, 31)] == [0.0, 0.0, 0.0]
    assert [wilson_interval(1.0, n)[1] for n in (4, 10, 19)] == [1.0, 1.0, 1.0]
    records = [
        {"step": 0, "reward_mean": 0.1, "eval/success_rate": 0.2, "eval/success_n": 200}
        | dict(zip(("eval/success_low", "eval/success_high"), wilson_interval(0.2, 200), strict=True)),
        {"step": 1, "reward_mean": 0.2, "eval/success_rate": 0.5, "eval/success_n": 200}
        | dict(zip(("eval/success_low", "eval/success_high"), wilson_interval(0.5, 200), strict=True)),
    ]
    line = summary(records, out=tmp_path, steps=1, wall_s=3.0)
    assert "eval/success_rate: 0.200 [0.150, 0.261] of 200 -> 0.500 [0.431, 0.569] of 200" in line
