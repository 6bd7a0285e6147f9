"""The pieces of megatron LoRA that need no process group: target names, the row mask of a fused
layer that adapts some of its projections, and the gradient layout fix of the frozen output layer."""

from __future__ import annotations

import pytest
import torch

from interlens_mcore.megatron.lora import LoRAOptions, _row_mask, _StridedGrad, targets
from interlens_mcore.megatron.model import ModelLayout


def _layout(tp: int) -> ModelLayout:
    # 4 query heads in 2 key/value groups of head size 2: linear_qkv's rows per group are
    # [q q q q | k k | v v] (2 queries of 2 rows, one k head, one v head)
    return ModelLayout(
        family="llama",
        num_layers=1,
        hidden_size=8,
        ffn_hidden_size=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        vocab_size=10,
        padded_vocab_size=10,
        tp_size=tp,
        rope_base=10000.0,
        norm_eps=1e-6,
        qkv_bias=False,
        tied_embeddings=True,
        max_position=32,
    )


def test_target_names_map_onto_megatron_layers_in_their_fused_order():
    assert targets("all-linear") == {
        "linear_qkv": ("q_proj", "k_proj", "v_proj"),
        "linear_proj": ("o_proj",),
        "linear_fc1": ("gate_proj", "up_proj"),
        "linear_fc2": ("down_proj",),
    }
    assert targets(("v_proj", "q_proj", "linear_fc2")) == {
        "linear_qkv": ("q_proj", "v_proj"),
        "linear_fc2": ("down_proj",),
    }
    with pytest.raises(ValueError, match="'lm_head' is not a linear layer of the Megatron model"):
        targets(("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="LoRAOptions.rank must be >= 1, got 0"):
        LoRAOptions(rank=0)


def test_row_mask_keeps_the_named_projections_rows():
    # q and v adapted, k not: per group [1 1 1 1 0 0 1 1]
    group = [1.0] * 4 + [0.0] * 2 + [1.0] * 2
    assert _row_mask("linear_qkv", _layout(1), ("q_proj", "v_proj")).tolist() == group * 2
    # at TP=2 each rank holds one whole group
    assert _row_mask("linear_qkv", _layout(2), ("q_proj", "v_proj")).tolist() == group
    # linear_fc1 at TP=2: a rank holds [gate_r; up_r], 3 rows each
    assert _row_mask("linear_fc1", _layout(2), ("up_proj",)).tolist() == [0.0] * 3 + [1.0] * 3
    assert _row_mask("linear_fc1", _layout(2), ("gate_proj", "up_proj")) is None


def test_the_output_layers_gradient_gets_strides_matmul_can_fold():
    # the gradient megatron's frozen output layer receives: a [1, T, V] tensor's transpose
    grad = torch.randn(1, 5, 7).transpose(0, 1)  # [5, 1, 7], strides (7, 35, 1)
    assert grad.is_contiguous()  # torch ignores the size-1 dimension's stride...
    assert grad.stride() == (7, 35, 1)  # ...which keeps matmul from folding it into a matrix
    fixed = _StridedGrad.backward(None, grad)
    assert fixed.stride() == (7, 7, 1) and torch.equal(fixed, grad)
