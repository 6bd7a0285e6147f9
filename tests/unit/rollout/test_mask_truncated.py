"""`mask_truncated_completions` (TRL's name; ms-swift's `overlong_filter`): samples cut off leave the
loss, and still count in their group's baseline."""

from __future__ import annotations

import torch

from interlens_mcore.rollout.rollouter import RolloutConfig, cut_short, rollout_advantages
from interlens_mcore.types import Status, Trajectory, TurnSpan


def _sample(reward: float, last: str, status: Status = Status.STOPPED) -> Trajectory:
    # two trained replies: the first ended on its stop token, the last as `last` says
    spans = [
        TurnSpan(start=1, end=2, speaker="policy", trained=True, finish_reason="stop"),
        TurnSpan(start=3, end=4, speaker="policy", trained=True, finish_reason=last),
    ]
    t = Trajectory(
        token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 0, 1], rollout_logprobs=None, turns=spans, group=0
    )
    t.reward, t.status = reward, status
    return t


def test_cut_off_samples_leave_the_loss_not_the_baseline():
    group = [_sample(1.0, "stop"), _sample(0.0, "length"), _sample(0.5, "stop", Status.TRUNCATED)]
    assert [cut_short(t) for t in group] == [False, True, True]
    plain = RolloutConfig(num_generations=3, scale_by_std=False)
    masked = RolloutConfig(num_generations=3, scale_by_std=False, mask_truncated_completions=True)
    adv, keep = rollout_advantages(group, plain)
    adv_m, keep_m = rollout_advantages(group, masked)
    assert keep.tolist() == [True, True, True] and keep_m.tolist() == [True, False, False]
    assert torch.equal(adv, adv_m)  # the baseline is the mean of all three either way
    assert adv_m[0].item() == 0.5
