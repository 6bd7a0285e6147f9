"""A reward function that raises for one sample fails that sample only; a bad return value stays an error."""

from __future__ import annotations

import pytest
from support.reward_samples import row, sample

from interlens_mcore.grpo.rewards import NoEnvironmentReward, RewardError, WeightedRewards, environment_reward
from interlens_mcore.rewards import adapt
from interlens_mcore.types import Status


def picky(trajectories, rows):
    return [{"ok": 1.0}[t.infos.completion] for t in trajectories]  # KeyError on any other text


def test_the_samples_a_function_raises_for_fail_and_the_others_keep_their_values():
    calls = []

    def counted(trajectories, rows):
        calls.append(len(trajectories))
        return [2.0 for _ in trajectories]

    ts = [sample("ok"), sample("bad"), sample("ok")]
    totals, parts = WeightedRewards([picky, counted]).score(ts, [row()] * 3)
    assert [t.status for t in ts] == [Status.STOPPED, Status.FAILED, Status.STOPPED]
    assert ts[1].infos.stop_reason == "reward picky: KeyError: 'bad'"
    assert totals == [3.0, 0.0, 3.0] and parts == {"picky": [1.0, None, 1.0], "counted": [2.0, None, 2.0]}
    assert calls == [2]  # later functions score only the samples still alive


def test_a_failed_sample_is_not_given_to_reward_functions_and_scores_zero():
    seen = []

    def trl(completions, **kwargs):
        seen.extend(c[0]["content"] for c in completions)
        return [1.0 for _ in completions]

    ts = [sample("a"), sample("b")]
    ts[0].status, ts[0].infos.stop_reason = Status.FAILED, "scheduler: ValueError: boom"
    ts[1].infos.env_reward = 0.5
    totals, _ = WeightedRewards([environment_reward, adapt(trl, what="--reward")]).score(ts, [row()] * 2)
    assert totals == [0.0, 1.5] and seen == ["b"]
    assert environment_reward(ts, [row()] * 2) == [0.0, 0.5]  # FAILED: 0.0 (no env reward needed)


def test_raise_errors_lets_the_first_exception_through():
    ts = [sample("ok"), sample("bad")]
    with pytest.raises(KeyError, match="bad"):
        WeightedRewards([picky], raise_errors=True).score(ts, [row()] * 2)


def test_a_returned_value_that_is_no_number_is_a_reward_error_not_a_failed_sample():
    def wrong(trajectories, rows):
        return ["1.0" for _ in trajectories]

    ts = [sample("ok")]
    with pytest.raises(RewardError, match="returned '1.0' for trajectory 0"):
        WeightedRewards([wrong]).score(ts, [row()])
    assert ts[0].status is Status.STOPPED


def test_reward_functions_are_the_reward_of_a_task_without_one_of_its_own():
    def length(trajectories, rows):
        return [float(len(t.infos.completion)) for t in trajectories]

    ts = [sample("ok"), sample("three")]  # dataset rows: no environment reward
    totals, parts = WeightedRewards([environment_reward, length]).score(ts, [row()] * 2)
    assert parts == {"env": [None, None], "length": [2.0, 5.0]} and totals == [2.0, 5.0]
    ts[1].infos.env_reward = 0.5  # where the task gives one, it counts beside them
    totals, parts = WeightedRewards([environment_reward, length]).score(ts, [row()] * 2)
    assert parts["env"] == [None, 0.5] and totals == [2.0, 5.5]
    with pytest.raises(NoEnvironmentReward, match=r"give the task a reward function \(--reward MODULE:FN\)"):
        WeightedRewards([environment_reward]).score([sample("ok")], [row()])


def test_a_collective_function_runs_before_user_functions_that_may_raise():
    # a user function raising on one rank must not leave the others waiting in the judge's round
    calls = []

    class Round:
        name, collective = "judge", True

        def __call__(self, trajectories, rows):
            calls.append("judge")
            return [0.5 for _ in trajectories]

    def user(trajectories, rows):
        calls.append("user")
        raise RuntimeError("broken")

    rewards = WeightedRewards([user, Round()], raise_errors=True)
    with pytest.raises(RuntimeError, match="broken"):
        rewards.score([sample("a")], [row()])
    assert calls == ["judge", "user"]
