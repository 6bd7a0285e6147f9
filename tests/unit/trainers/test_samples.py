"""The per-sample facts and the step's sample figures (one process: the gathers return this rank's)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from interlens_mcore.rollout.rollouter import Rollout
from interlens_mcore.types import Status, Trajectory, TurnSpan
from trainers.report.record import rollout_figures, train_figures
from trainers.report.samples import facts_of, sample_figures, zero_std_fraction


def _traj(
    *,
    group: int = 0,
    reward: float = 0.0,
    sampled: int = 2,
    reasons: tuple[str, ...] = ("stop",),
    status: Status = Status.STOPPED,
    seat: str = "policy",
    **infos: object,
) -> Trajectory:
    # a prompt token, then `sampled` trained tokens split over one span per finish reason
    ids = [1] * (1 + sampled)
    spans, start, width = [], 1, sampled // len(reasons)
    for reason in reasons:
        spans.append(
            TurnSpan(start=start, end=start + width, speaker=seat, trained=True, finish_reason=reason)
        )
        start += width
    t = Trajectory(
        token_ids=ids,
        loss_mask=[0] + [1] * sampled,
        rollout_logprobs=None,
        turns=spans,
        participant=seat,
        group=group,
        status=status,
        infos={"turns": 2, **infos},
    )
    t.reward = reward
    return t


def _facts(*trajectories: Trajectory) -> list:
    return [facts_of(t, float(t.reward or 0.0)) for t in trajectories]


def test_lengths_and_the_share_of_replies_cut_at_the_cap():
    facts = _facts(
        _traj(sampled=2, reasons=("length",)),  # 1 reply, cut
        _traj(sampled=6, reasons=("stop", "length", "stop")),  # 3 replies, 1 cut
    )
    out = sample_figures([facts])
    assert out["completions/mean_length"] == 4.0
    assert (out["completions/min_length"], out["completions/max_length"]) == (2, 6)
    assert out["completions/clipped_ratio"] == pytest.approx(2 / 4)  # 2 of the 4 replies


def test_zero_std_groups_are_counted_per_rank():
    # group 0 of rank 0 has equal rewards, group 1 does not; rank 1's group 0 is another group
    rank0 = _facts(
        _traj(group=0, reward=1.0), _traj(group=0, reward=1.0), _traj(group=1), _traj(group=1, reward=1)
    )
    rank1 = _facts(_traj(group=0, reward=0.0), _traj(group=0, reward=0.5))
    assert zero_std_fraction([rank0, rank1]) == pytest.approx(1 / 3)
    # had the ranks' group 0 been merged, it would hold rewards 1, 1, 0, 0.5: one group of two
    assert sample_figures([rank0, rank1])["frac_reward_zero_std"] == pytest.approx(1 / 3)


def test_invalid_moves_and_actions():
    facts = _facts(
        _traj(invalid_moves=1),  # textarena: the rejected move ended the game
        _traj(invalid_moves=0),
        _traj(invalid_actions=3, steps=3),  # gymnasium: no valid action at all
        _traj(invalid_actions=1, steps=5),  # one invalid of five: the episode went on
    )
    assert [f.ended_invalid for f in facts] == [True, False, True, False]
    out = sample_figures([facts])
    assert out["invalid/per_sample"] == pytest.approx((1 + 0 + 3 + 1) / 4)
    assert out["invalid/ended_fraction"] == 0.5
    # a task that counts no invalid moves logs neither figure
    assert "invalid/per_sample" not in sample_figures([_facts(_traj())])


def test_tool_figures_only_when_tools_were_offered():
    facts = _facts(
        _traj(tool_calls=2, tool_valid_calls=1, tool_errors=1, tool_turns=1),
        _traj(tool_calls=0, tool_valid_calls=0, tool_errors=0, tool_turns=0),
    )
    out = sample_figures([facts])
    assert out["tool/calls_per_sample"] == 1.0 and out["tool/valid_fraction"] == 0.5
    assert out["tool/errors_per_sample"] == 0.5 and out["turns_per_sample"] == 2.0
    assert not any(k.startswith("tool/") for k in sample_figures([_facts(_traj())]))


def test_agent_figures_from_the_sessions_counts_only_for_agents():
    facts = _facts(_traj(agent_calls=3, agent_branches=1), _traj(agent_calls=0, agent_branches=0))
    out = sample_figures([facts])
    assert out["agent/calls_per_sample"] == 1.5 and out["agent/branches_per_sample"] == 0.5
    assert not any(k.startswith("agent/") for k in sample_figures([_facts(_traj())]))


@dataclass
class _Row:
    name: str


def test_rollout_figures_per_dataset_seat_and_truncation():
    trajectories = [
        _traj(reward=1.0, seat="player_0", success=1.0, outcome={"player_0": 1.0, "player_1": 0.0}),
        _traj(reward=0.0, seat="player_1", success=0.0, status=Status.TRUNCATED),
        _traj(reward=0.5, seat="player_0"),
        _traj(reward=0.25, seat="player_1"),
    ]
    rows = [_Row("chain_sum"), _Row("chain_sum"), _Row("leg_counting"), _Row("leg_counting")]
    out = rollout_figures(
        Rollout(trajectories=trajectories, rows=rows), {"env": []}, None, dataset_of=lambda r: r.name
    )
    assert out["reward_mean/dataset/chain_sum"] == 0.5 and out["reward_mean/dataset/leg_counting"] == 0.375
    assert out["reward_mean/player_0"] == 0.75 and out["reward_mean/player_1"] == 0.125
    assert out["truncated"] == 1 and out["truncated_fraction"] == 0.25 and out["success_rate"] == 0.5
    # a source that names no dataset (dataset_of returns None) logs no per-dataset reward
    plain = rollout_figures(
        Rollout(trajectories=trajectories, rows=rows), {}, None, dataset_of=lambda r: None
    )
    assert not any(k.startswith("reward_mean/dataset/") for k in plain)


def test_the_loss_metrics_keep_their_is_names():
    out = train_figures(
        {"is/kl_k3": 0.1, "is/weight_mean": 1.0, "is/weight/max": 2.0, "kl/ref": 0.3}, skipped_steps=0
    )
    assert {"is/kl_k3", "is/weight_mean", "is/weight/max", "kl"} <= set(out)
    assert not any(k.startswith("is_") for k in out)


def test_the_rows_of_a_reasoning_gym_mix_name_their_dataset_through_tools_too():
    from interlens_mcore.tasks.reasoning_gym import source
    from interlens_mcore.tools import with_tools
    from interlens_mcore.tools.examples import calculator

    mix = source("chain_sum+leg_counting")
    rows = mix.rows(16, seed=0)
    names = [mix.dataset_of(r) for r in rows]
    assert set(names) == {"chain_sum", "leg_counting"}  # 16 draws of an even mix hold both
    tooled = with_tools(mix, [calculator], isolation="thread")
    assert [tooled.dataset_of(r) for r in tooled.rows(16, seed=0)] == names
    single = source("chain_sum")
    assert single.dataset_of(single.rows(1, seed=0)[0]) is None  # one dataset: no per-dataset figure


def test_reward_parts_are_averaged_over_the_samples_they_apply_to_and_logged_metrics_written():
    trajectories = [_traj(reward=1.0), _traj(reward=0.0)]
    out = rollout_figures(
        Rollout(trajectories=trajectories, rows=[None, None]),
        {"env": [1.0, 0.0], "accuracy_reward": [None, 0.5]},  # None: not applicable (TRL)
        None,
        logged={"judge_calls": [2.0, 4.0]},
    )
    assert out["reward/env"] == 0.5 and out["reward/accuracy_reward"] == 0.5
    assert out["reward_metric/judge_calls"] == 3.0


def test_evaluation_reports_each_rate_with_its_count_and_interval():
    from trainers.report.record import evaluation_figures, wilson_interval

    trajectories = [
        _traj(success=1.0, **{"rate/first_attempt": 1.0}),
        _traj(success=1.0, **{"rate/first_attempt": 0.0, "rate/second_attempt_after_miss": 1.0}),
        _traj(success=0.0, **{"rate/first_attempt": 0.0, "rate/second_attempt_after_miss": 0.0}),
        # not rates: a bool, a number out of [0, 1], text; and a sample that set none
        _traj(success=0.0, **{"rate/first_attempt": True, "rate/odd": 3.0, "rate/text": "yes"}),
    ]
    out = evaluation_figures(Rollout(trajectories=trajectories, rows=[None] * 4))
    assert out["eval/success_rate"] == 0.5 and out["eval/success_n"] == 4
    assert out["eval/rate/first_attempt"] == pytest.approx(1 / 3) and out["eval/rate/first_attempt_n"] == 3
    assert out["eval/rate/second_attempt_after_miss"] == 0.5
    assert out["eval/rate/second_attempt_after_miss_n"] == 2
    low, high = wilson_interval(0.5, 2)
    key = "eval/rate/second_attempt_after_miss"
    assert (out[f"{key}_low"], out[f"{key}_high"]) == (low, high)
    assert not [k for k in out if "odd" in k or "text" in k]


def test_reward_png_draws_each_reported_rate_with_its_interval(tmp_path):
    from trainers.report.plot import plot_run, rate_keys

    figures = {"eval/success_rate": 0.5, "eval/success_low": 0.4, "eval/success_high": 0.6}
    for name in ("eval/rate/win_vs_initial", "eval/rate/win_vs_initial/player_a"):
        figures.update({name: 0.5, f"{name}_n": 8, f"{name}_low": 0.2, f"{name}_high": 0.8})
    records = [{"step": 0, **figures}, {"step": 1, "reward_mean": 0.5, "kl": 0.0, "loss": 0.1}]
    keys = sorted({k for r in records for k in r})
    # the rate itself, not its count, bounds or per-seat part
    assert rate_keys(keys) == ["eval/success_rate", "eval/rate/win_vs_initial"]
    plot_run(records, tmp_path / "reward.png")
    assert (tmp_path / "reward.png").stat().st_size > 0
