"""Dynamic sampling's batch: which prompts of which rounds make it, renumbered, with their values."""

from __future__ import annotations

import pytest
import torch

from interlens_mcore.rollout.rollouter import Rollout
from interlens_mcore.types import Status, Trajectory
from trainers.dynamic import informative, prompt_spans, refill, shortfall


def _rollout(rewards: list[list[float]], tag: str, failed: tuple[int, ...] = ()) -> Rollout:
    """One prompt per inner list, one trajectory per reward; advantages = reward - group mean."""
    trajectories, rows, adv = [], [], []
    for g, group in enumerate(rewards):
        mean = sum(group) / len(group)
        for k, r in enumerate(group):
            t = Trajectory(token_ids=[1, 2], loss_mask=[0, 1], rollout_logprobs=None, group=g)
            t.reward = r
            t.status = Status.FAILED if (g, k) in failed else Status.STOPPED
            trajectories.append(t)
            rows.append(f"{tag}{g}")
            adv.append(r - mean)
    keep = torch.tensor([t.status is not Status.FAILED for t in trajectories])
    return Rollout(trajectories=trajectories, rows=rows, advantages=torch.tensor(adv), keep=keep)


def test_informative_prompts_are_those_whose_kept_samples_disagree():
    r = _rollout([[1.0, 0.0], [0.5, 0.5], [1.0, 0.0]], "a", failed=((2, 1),))
    spans = prompt_spans(r)
    assert spans == [[0, 1], [2, 3], [4, 5]]
    # the third prompt's disagreeing sample failed: what is left agrees
    assert [informative(r, s) for s in spans] == [True, False, False]
    assert shortfall([r], 3) == 2 and shortfall([r], 1) == 0


def test_refill_takes_informative_prompts_in_round_order_and_renumbers_them():
    first = _rollout([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]], "a")
    second = _rollout([[0.2, 0.2], [0.0, 1.0], [0.3, 0.9]], "b")
    parts_a = {"env": [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]}
    parts_b = {"env": [0.2, 0.2, 0.0, 1.0, 0.3, 0.9]}
    batch, parts, kept = refill([(first, parts_a), (second, parts_b)], 3)
    assert kept == 3
    assert batch.rows == ["a1", "a1", "b1", "b1", "b2", "b2"]
    assert [t.group for t in batch.trajectories] == [0, 0, 1, 1, 2, 2]
    assert parts == {"env": [1.0, 0.0, 0.0, 1.0, 0.3, 0.9]}
    assert batch.advantages.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, -0.3, 0.3])
    assert batch.keep.tolist() == [True] * 6


def test_a_batch_still_short_fills_up_with_the_first_rounds_other_prompts():
    first = _rollout([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]], "a")
    second = _rollout([[0.2, 0.2], [0.5, 0.5], [0.3, 0.3]], "b")
    batch, _, kept = refill([(first, {}), (second, {})], 3)
    assert kept == 1
    # the informative prompt first, then the first round's others in order: the size is kept
    assert batch.rows == ["a1", "a1", "a0", "a0", "a2", "a2"]
    assert [t.group for t in batch.trajectories] == [0, 0, 1, 1, 2, 2]
