import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from interlens_mcore.grpo.batch import TrainingBatch, build_batch, pad_id
from interlens_mcore.types import Trajectory, TurnSpan


def span(start, end):
    return TurnSpan(start=start, end=end, speaker="policy", trained=True)


def two_samples():
    # Sample 0: tokens 5 6 | 7 8 | 9, trained turn [2, 4) with complete logprobs.
    # Sample 1: tokens 1 | 2 | 3 | 4, mask-1 at 1 and 3, no spans (two runs = two turns),
    #           and no logprobs (IS off for it).
    a = Trajectory(
        token_ids=[5, 6, 7, 8, 9],
        loss_mask=[0, 0, 1, 1, 0],
        rollout_logprobs=[-0.5, -0.25],
        turns=[span(2, 4)],
    )
    b = Trajectory(token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 0, 1], rollout_logprobs=None)
    return [a, b]


def test_packed_hand_built():
    b = build_batch(two_samples(), [1.0, -2.0], pad_to_multiple=4, pad_id=0)
    # 9 real tokens padded to 12; targets are the next token of the same sample, the last
    # token of each sample (positions 4 and 8) has none (pad_id, mask 0).
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 0, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]
    assert b.targets.tolist() == [[6, 7, 8, 9, 0, 2, 3, 4, 0, 0, 0, 0]]
    # Token 7 (sample 0, index 2) is predicted at position 1, token 8 at 2; sample 1's token 2
    # at position 5 and token 4 at position 7.
    assert b.loss_mask.long().tolist() == [[0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 0]]
    assert b.rollout_logprobs.tolist() == [[0, -0.5, -0.25, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert b.advantages.tolist() == [[1, 1, 1, 1, 1, -2, -2, -2, -2, 0, 0, 0]]
    assert b.segment_ids.tolist() == [[-1, 0, 0, -1, -1, 1, -1, 2, -1, -1, -1, -1]]
    assert b.sample_ids.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 1, -1, -1, -1]]
    assert b.logprobs_complete.tolist() == [True, False]
    assert b.cu_seqlens.tolist() == [0, 5, 9] and b.cu_seqlens.dtype == torch.int32
    assert (b.num_samples, b.num_tokens, b.num_loss_tokens, b.num_segments) == (2, 9, 4, 3)
    assert b.padding_fraction == pytest.approx(3 / 12)

    params = b.packed_seq_params()
    # The 3 padding tokens form a trailing pseudo-sequence so THD attention covers the row.
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 5, 9, 12] and params.cu_seqlens_kv.tolist() == [0, 5, 9, 12]
    assert params.max_seqlen_q == params.max_seqlen_kv == 5


def test_packed_without_padding_has_no_extra_segment():
    b = build_batch(two_samples(), [1.0, -2.0], pad_to_multiple=9)
    assert b.input_ids.shape == (1, 9)
    assert b.packed_seq_params().cu_seqlens_q.tolist() == [0, 5, 9]


def test_padded_hand_built():
    b = build_batch(two_samples(), torch.tensor([1.0, -2.0]), layout="padded", pad_to_multiple=4, pad_id=3)
    # Longest sample 5 -> T = 8.
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 3, 3, 3], [1, 2, 3, 4, 3, 3, 3, 3]]
    assert b.targets.tolist() == [[6, 7, 8, 9, 3, 3, 3, 3], [2, 3, 4, 3, 3, 3, 3, 3]]
    assert b.position_ids.tolist() == [list(range(8))] * 2
    assert b.loss_mask.long().tolist() == [[0, 1, 1, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0]]
    assert b.rollout_logprobs.tolist() == [[0, -0.5, -0.25, 0, 0, 0, 0, 0], [0] * 8]
    assert b.segment_ids.tolist() == [[-1, 0, 0, -1, -1, -1, -1, -1], [1, -1, 2, -1, -1, -1, -1, -1]]
    assert b.sample_ids.tolist() == [[0] * 5 + [-1] * 3, [1] * 4 + [-1] * 4]
    assert b.seq_lens.tolist() == [5, 4] and b.cu_seqlens.tolist() == [0, 5, 9]
    with pytest.raises(ValueError, match="packed"):
        b.packed_seq_params()


def test_incomplete_logprobs_are_dropped_for_that_sample_only():
    a, b = two_samples()
    short = dataclasses.replace(b, rollout_logprobs=[-1.0])  # 1 logprob for 2 trained tokens
    batch = build_batch([a, short], [0.0, 0.0])
    assert batch.logprobs_complete.tolist() == [True, False]
    assert batch.rollout_logprobs[0, 5:].abs().sum() == 0
    assert batch.rollout_logprobs[0, 1:3].tolist() == [-0.5, -0.25]


@pytest.mark.parametrize(
    "trajs, adv, kwargs, name",
    [
        ([], [], {}, "trajectories"),
        ("two", [1.0], {}, "advantages"),
        ("two", [1.0, float("inf")], {}, "advantages"),
        ("two", [[1.0, 2.0]], {}, "advantages"),
        ("two", [1.0, 2.0], {"layout": "thd"}, "layout"),
        ("two", [1.0, 2.0], {"pad_to_multiple": 0}, "pad_to_multiple"),
        ("two", [1.0, 2.0], {"pad_id": -100}, "pad_id"),
        ([Trajectory(token_ids=[1, -5], loss_mask=[0, 1], rollout_logprobs=None)], [1.0], {}, "token_ids"),
        ([{"token_ids": [1]}], [1.0], {}, r"trajectories\[0\]"),
        (
            [Trajectory(token_ids=[1, 2], loss_mask=[0, 0], rollout_logprobs=None)],
            [1.0],
            {},
            r"trajectories\[0\]",
        ),
        ([Trajectory(token_ids=[1, 2], loss_mask=[1, 1], rollout_logprobs=None)], [1.0], {}, "loss_mask"),
        (
            [Trajectory(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], rollout_logprobs=None, turns=[span(1, 2)])],
            [1.0],
            {},
            "outside every trained turn span",
        ),
        (
            [
                Trajectory(
                    token_ids=[1, 2, 3],
                    loss_mask=[0, 1, 1],
                    rollout_logprobs=None,
                    turns=[span(1, 3), span(2, 3)],
                )
            ],
            [1.0],
            {},
            "overlap",
        ),
    ],
)
def test_bad_input(trajs, adv, kwargs, name):
    trajs = two_samples() if trajs == "two" else trajs
    with pytest.raises(ValueError, match=name):
        build_batch(trajs, adv, **kwargs)


def test_training_batch_validates_shapes():
    b = build_batch(two_samples(), [1.0, -2.0])
    with pytest.raises(ValueError, match="targets"):
        dataclasses.replace(b, targets=b.targets[:, :-1])
    with pytest.raises(ValueError, match="loss_mask"):
        dataclasses.replace(b, loss_mask=b.loss_mask.float())
    with pytest.raises(ValueError, match="cu_seqlens"):
        dataclasses.replace(b, cu_seqlens=b.cu_seqlens[:-1])
    with pytest.raises(ValueError, match="layout"):
        dataclasses.replace(b, layout="ragged")
    assert isinstance(b.to("cpu"), TrainingBatch)


@st.composite
def trajectory_sets(draw):
    """Random trajectories: a prompt, then turns of (other speaker, policy), maybe a tail.

    Returns (trajectories, expected turns per sample as lists of mask-1 token indices).
    """
    out, turns_per_sample = [], []
    for _ in range(draw(st.integers(1, 5))):
        ids, mask, spans, turns = [], [], [], []
        with_spans = draw(st.booleans())
        for _ in range(draw(st.integers(1, 4))):
            ids += draw(st.lists(st.integers(0, 50), min_size=1, max_size=4))  # prompt / env message
            mask += [0] * (len(ids) - len(mask))
            start = len(ids)
            ids += draw(st.lists(st.integers(0, 50), min_size=1, max_size=5))  # sampled tokens
            mask += [1] * (len(ids) - start)
            if with_spans and draw(st.booleans()):  # an untrained token inside the turn's span
                ids.append(draw(st.integers(0, 50)))
                mask.append(0)
            spans.append(span(start, len(ids)))
            turns.append([u for u in range(start, len(ids)) if mask[u]])
        if draw(st.booleans()):
            ids.append(draw(st.integers(0, 50)))
            mask.append(0)
        kind = draw(st.sampled_from(["complete", "none", "short"]))
        n_trained = sum(mask)
        lps = draw(st.lists(st.floats(-20, 0, width=32), min_size=n_trained, max_size=n_trained))
        lps = {"complete": lps, "none": None, "short": lps[:-1]}[kind]
        out.append(
            Trajectory(token_ids=ids, loss_mask=mask, rollout_logprobs=lps, turns=spans if with_spans else [])
        )
        turns_per_sample.append(turns)
    return out, turns_per_sample


@settings(max_examples=60, deadline=None)
@given(data=trajectory_sets(), multiple=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_every_trained_token_lands_on_its_own_target_position(data, multiple, seed):
    trajs, turns = data
    adv = torch.randn(len(trajs), generator=torch.Generator().manual_seed(seed))
    packed = build_batch(trajs, adv, pad_to_multiple=multiple, pad_id=99)
    padded = build_batch(trajs, adv, layout="padded", pad_to_multiple=multiple, pad_id=99)
    assert packed.input_ids.shape[1] % multiple == 0 and padded.input_ids.shape[1] % multiple == 0

    segment = 0
    for i, t in enumerate(trajs):
        start = int(packed.cu_seqlens[i])
        lp = iter(t.rollout_logprobs or [])
        for turn in turns[i]:
            for u in turn:
                expected_lp = next(lp) if t.logprobs_complete else 0.0
                for row, p, b in ((0, start + u - 1, packed), (i, u - 1, padded)):
                    assert b.targets[row, p] == t.token_ids[u]
                    assert b.loss_mask[row, p]
                    assert b.rollout_logprobs[row, p] == pytest.approx(expected_lp, abs=1e-6)
                    assert b.advantages[row, p] == adv[i]
                    assert b.segment_ids[row, p] == segment
                    assert b.sample_ids[row, p] == i
            segment += 1
        assert bool(packed.logprobs_complete[i]) == t.logprobs_complete
    n_trained = sum(sum(t.loss_mask) for t in trajs)
    assert packed.num_loss_tokens == padded.num_loss_tokens == n_trained
    assert packed.num_segments == padded.num_segments == segment
    assert not packed.loss_mask[packed.sample_ids < 0].any()


def test_pad_id_is_the_pad_token_else_eos_and_names_a_tokenizer_with_neither():
    @dataclasses.dataclass
    class Ids:
        pad_token_id: int | None
        eos_token_id: int | None

    assert pad_id(Ids(pad_token_id=3, eos_token_id=7)) == 3
    assert pad_id(Ids(pad_token_id=None, eos_token_id=7)) == 7
    with pytest.raises(ValueError, match="tokenizer Ids has neither a pad nor an eos token id"):
        pad_id(Ids(pad_token_id=None, eos_token_id=None))
