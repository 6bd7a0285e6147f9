import math

import pytest
import torch

from interlens_mcore.grpo.advantages import group_advantages, trajectory_advantages
from interlens_mcore.types import Trajectory


def test_mean_centred_std_scaled():
    # Group 7: rewards [1, 0, 0, 1]: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735.
    #   A = +-0.5 / 0.57735 = +-0.866025.
    # Group 3: rewards [2, 4]: mean 3, var = (1 + 1) / 1 = 2, std = 1.41421; A = -+0.707107.
    adv, keep = group_advantages([1, 0, 2, 0, 1, 4], [7, 7, 3, 7, 7, 3], eps=0.0)
    s = math.sqrt(3) / 2
    r = 1 / math.sqrt(2)
    assert adv.tolist() == pytest.approx([s, -s, -r, -s, s, r], abs=1e-6)
    assert keep.all()
    assert adv.dtype == torch.float32


def test_without_std_and_leave_one_out():
    # Group [1, 2, 6]: mean 3; centred [-2, -1, 3].
    # Leave-one-out baselines: (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5 -> [-3, -1.5, 4.5]
    # = 3/2 * centred, as n / (n - 1) = 3/2.
    adv, _ = group_advantages([1.0, 2.0, 6.0], [0, 0, 0], scale_by_std=False)
    assert adv.tolist() == pytest.approx([-2.0, -1.0, 3.0])
    adv, _ = group_advantages([1.0, 2.0, 6.0], [0, 0, 0], scale_by_std=False, leave_one_out=True)
    assert adv.tolist() == pytest.approx([-3.0, -1.5, 4.5])


def test_zero_variance_groups_are_zero_and_droppable():
    # Group 0 has equal rewards (0.1 is not exact in binary; the centring must still give 0).
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    adv, keep = group_advantages(rewards, groups, eps=1e-6)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert keep.tolist() == [True] * 5
    adv, keep = group_advantages(rewards, groups, drop_zero_variance=True)
    assert keep.tolist() == [False, False, False, True, True]
    # Group 1: [1, 0], std = sqrt(0.5) -> A = +-0.5 / 0.7071 = +-0.7071 (eps 1e-6 shifts the 6th digit)
    assert adv[3:].tolist() == pytest.approx([0.70710, -0.70710], abs=1e-5)


def test_single_sample_group_has_zero_advantage():
    adv, keep = group_advantages([5.0], [0])
    assert adv.tolist() == [0.0] and keep.tolist() == [True]


@pytest.mark.parametrize(
    "rewards, groups, kwargs, name",
    [
        ([], [], {}, "rewards"),
        ([1.0, 2.0], [0], {}, "groups"),
        ([1.0, float("nan")], [0, 0], {}, "rewards"),
        ([1.0, 2.0], [0.0, 0.0], {}, "groups"),
        ([1.0, 2.0], [0, 1], {"leave_one_out": True}, "leave_one_out"),
        ([1.0, 2.0], [0, 0], {"eps": -1.0}, "eps"),
    ],
)
def test_bad_input(rewards, groups, kwargs, name):
    with pytest.raises(ValueError, match=name):
        group_advantages(rewards, groups, **kwargs)


def test_trajectory_advantages_reads_reward_and_group():
    def traj(reward, group):
        return Trajectory(
            token_ids=[1, 2], loss_mask=[0, 1], rollout_logprobs=None, reward=reward, group=group
        )

    adv, _ = trajectory_advantages([traj(1.0, 0), traj(3.0, 0), traj(2.0, 1)], scale_by_std=False)
    assert adv.tolist() == [-1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match=r"trajectories\[1\].reward"):
        trajectory_advantages([traj(1.0, 0), traj(None, 0)])
