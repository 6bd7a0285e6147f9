"""Micro-batches end each sample at its last trained token: what follows is read by no trained
position, so the batch loses tokens and no logprob of the loss changes."""

from __future__ import annotations

import torch

from interlens_mcore.grpo.batch import build_batch
from interlens_mcore.rollout.rollouter import Rollout, micro_batches, trained_prefix
from interlens_mcore.types import Trajectory, TurnSpan

# a prompt (3), a trained reply (3), the environment's answer (2), a trained reply (2), a closing answer (3)
IDS = [11, 12, 13, 21, 22, 23, 31, 32, 41, 42, 51, 52, 53]
MASK = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0]
TURNS = [
    TurnSpan(start=0, end=3, speaker="user", trained=False),
    TurnSpan(start=3, end=6, speaker="policy", trained=True),
    TurnSpan(start=6, end=8, speaker="env", trained=False),
    TurnSpan(start=8, end=10, speaker="policy", trained=True),
    TurnSpan(start=10, end=13, speaker="env", trained=False),
]


def _trajectory(ids=IDS, mask=MASK, turns=TURNS) -> Trajectory:
    return Trajectory(
        token_ids=list(ids), loss_mask=list(mask), rollout_logprobs=[-0.5] * sum(mask), turns=turns
    )


def test_the_tail_after_the_last_trained_token_goes():
    t = _trajectory()
    cut = trained_prefix(t)
    assert cut.token_ids == IDS[:10] and cut.loss_mask == MASK[:10]
    assert [(s.start, s.end, s.speaker) for s in cut.turns] == [
        (0, 3, "user"),
        (3, 6, "policy"),
        (6, 8, "env"),
        (8, 10, "policy"),
    ]
    assert cut.rollout_logprobs == t.rollout_logprobs and cut.infos is t.infos
    assert t.token_ids == IDS  # the rollout's own trajectory is left whole


def test_a_span_running_past_the_end_is_cut_and_one_ending_on_a_trained_token_stays_whole():
    # a trained span whose last token (an end-of-turn id) carries no loss-mask 1
    mask = [0, 0, 1, 1, 0, 0]
    t = _trajectory(
        IDS[:6],
        mask,
        [
            TurnSpan(start=0, end=2, speaker="user", trained=False),
            TurnSpan(start=2, end=5, speaker="policy", trained=True),
            TurnSpan(start=5, end=6, speaker="env", trained=False),
        ],
    )
    cut = trained_prefix(t)
    assert len(cut.token_ids) == 4 and [(s.start, s.end) for s in cut.turns] == [(0, 2), (2, 4)]
    whole = _trajectory(IDS[:10], MASK[:10], TURNS[:4])
    assert trained_prefix(whole) is whole


def test_micro_batches_carry_the_cut_samples_with_the_same_targets_where_trained():
    trajectories = [_trajectory(), _trajectory(IDS[:10], MASK[:10], TURNS[:4])]
    rollout = Rollout(
        trajectories=trajectories,
        rows=[None, None],
        advantages=torch.tensor([1.0, -1.0]),
        keep=torch.ones(2, dtype=torch.bool),
    )
    (batch,) = micro_batches(rollout, micro_batch_size=2, layout="packed", pad_to_multiple=1, pad_id=0)
    whole = build_batch(trajectories, [1.0, -1.0])
    assert batch.input_ids.shape[1] == 20 and whole.input_ids.shape[1] == 23
    assert batch.seq_lens.tolist() == [10, 10]
    # the trained positions see the same tokens before them and predict the same targets
    for b in (batch, whole):
        assert int(b.loss_mask.sum()) == 10
    assert batch.targets[batch.loss_mask].tolist() == whole.targets[whole.loss_mask].tolist()
    assert (
        batch.rollout_logprobs[batch.loss_mask].tolist() == whole.rollout_logprobs[whole.loss_mask].tolist()
    )
    assert batch.segment_ids[batch.loss_mask].tolist() == whole.segment_ids[whole.loss_mask].tolist()
