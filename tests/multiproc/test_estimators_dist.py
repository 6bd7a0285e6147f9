"""The batch step of an advantage estimator on two gloo ranks: its statistics are over both ranks'
samples, so each rank's advantages equal a single process's on the union of the batch."""

from __future__ import annotations

import pytest
from support.dist import run_ranks

# (group, reward, trained tokens): rank 0 holds the first two groups, rank 1 the last two; the
# ranks' means and spreads differ, so statistics of one rank alone give other values
SAMPLES = [
    [(0, 1.0, 3), (0, 0.0, 1), (1, 2.0, 2), (1, 0.5, 4)],
    [(2, 5.0, 2), (2, 3.0, 6), (3, -1.0, 1), (3, -1.0, 5)],
]
CASES = [
    {"advantage_estimator": "reinforce_plus_plus"},
    {"advantage_estimator": "reinforce_plus_plus_baseline"},
    {"scale_rewards": "batch"},
]


def _advantages(samples, config) -> list[float]:
    from interlens_mcore import distributed
    from interlens_mcore.rollout.rollouter import Rollout, rollout_estimate, whole_batch_advantages
    from interlens_mcore.types import Status, Trajectory

    trajectories = []
    for group, reward, tokens, *status in samples:
        t = Trajectory(
            token_ids=list(range(tokens + 1)),
            loss_mask=[0] + [1] * tokens,
            rollout_logprobs=None,
            group=group,
        )
        t.reward, t.status = reward, Status.FAILED if status else Status.STOPPED
        trajectories.append(t)
    est = rollout_estimate(trajectories, config)
    rollout = Rollout(trajectories=trajectories, rows=[None] * len(trajectories))
    rollout.advantages, rollout.keep, rollout.batch_step = est.advantages, est.keep, est.batch
    whole_batch_advantages(rollout, lambda x: distributed.all_reduce(x, "sum"))
    return rollout.advantages.tolist()


def _rank(rank, world, kwargs):
    from interlens_mcore.rollout.rollouter import RolloutConfig

    return _advantages(SAMPLES[rank], RolloutConfig(num_generations=2, **kwargs))


@pytest.mark.parametrize("kwargs", CASES)
def test_batch_statistics_span_both_ranks(kwargs):
    from interlens_mcore.rollout.rollouter import RolloutConfig

    config = RolloutConfig(num_generations=2, **kwargs)
    union = _advantages(SAMPLES[0] + SAMPLES[1], config)  # one process, the whole batch
    alone = _advantages(SAMPLES[0], config)  # rank 0's samples with no other rank
    got = run_ranks(_rank, 2, kwargs, timeout=120)
    assert got[0] + got[1] == pytest.approx(union, rel=1e-6)
    assert got[0] != pytest.approx(alone, rel=1e-3)  # rank 1's samples moved rank 0's values


def _rank_one_failed(rank, world):
    from interlens_mcore.rollout.rollouter import RolloutConfig

    samples = SAMPLES[rank] if rank == 0 else [(g, r, n, "failed") for g, r, n in SAMPLES[rank]]
    return _advantages(samples, RolloutConfig(num_generations=2, advantage_estimator="reinforce_plus_plus"))


def test_a_rank_whose_samples_all_failed_still_joins():
    # rank 1 has nothing in the loss: it adds zeros to both all-reduces, so nobody waits, and rank 0
    # gets the statistics of its own samples alone
    from interlens_mcore.rollout.rollouter import RolloutConfig

    got = run_ranks(_rank_one_failed, 2, timeout=120)
    alone = _advantages(
        SAMPLES[0], RolloutConfig(num_generations=2, advantage_estimator="reinforce_plus_plus")
    )
    assert got[0] == pytest.approx(alone, rel=1e-6) and got[1] == [0.0] * 4
