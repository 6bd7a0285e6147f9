"""The loss metrics: declared keys, one reduction rule for micro-batches and ranks alike."""

from __future__ import annotations

import math

import pytest
import torch

from interlens_mcore.grpo.loss import objective
from interlens_mcore.grpo.loss.config import LossConfig
from interlens_mcore.grpo.loss.metrics import (
    METRIC_KEYS,
    empty_metrics,
    finalize_metrics,
    keys_by_reduction,
    merge_metrics,
    reduction,
)
from trainers import update as update_module

SAMPLE = torch.tensor([[0, 0, 0, 1, 1, -1]])
MASK = SAMPLE >= 0


def _call(config: LossConfig, *, shift: float = 0.0, **kwargs) -> dict[str, torch.Tensor]:
    lp = torch.full((1, 6), -1.0 + shift)
    _, metrics = objective.grpo_loss(
        lp,
        loss_mask=MASK,
        advantages=torch.tensor([[2.0, 2.0, 2.0, -1.0, -1.0, 0.0]]),
        rollout_logprobs=torch.tensor([[-2.0, -0.5, -1.0, -1.3, -0.7, 0.0]]),
        logprobs_complete=torch.tensor([True, True]),
        sample_ids=SAMPLE,
        segment_ids=SAMPLE,
        config=config,
        num_tokens=5,
        num_sequences=2,
        **kwargs,
    )
    return metrics


def test_a_key_reduces_by_its_suffix():
    assert [reduction(k) for k in ("is/weight/max", "is/weight/min", "tokens", "max", "a/max/b")] == [
        "max",
        "min",
        "sum",
        "sum",
        "sum",
    ]
    groups = keys_by_reduction(["b/min", "a", "z/max", "c"])
    assert groups == {"sum": ["a", "c"], "max": ["z/max"], "min": ["b/min"]}
    assert keys_by_reduction(["a"]) == {"sum": ["a"], "max": [], "min": []}


def test_empty_metrics_are_declared_not_computed(monkeypatch):
    def no_loss(*args, **kwargs):
        raise AssertionError("empty_metrics must not run the loss")

    monkeypatch.setattr(objective, "_kept_tokens", no_loss)
    empty = empty_metrics()
    assert list(empty) == list(METRIC_KEYS) and len(set(METRIC_KEYS)) == len(METRIC_KEYS)
    assert {k: float(v) for k, v in empty.items() if reduction(k) == "min"} == {"is/weight/min": math.inf}
    assert all(float(v) == 0.0 for k, v in empty.items() if reduction(k) != "min")


@pytest.mark.parametrize(
    "config, kwargs",
    [
        (LossConfig(bypass=True, is_mode="none", beta=0.0), {}),
        (LossConfig(is_batch_normalize=True, beta=0.0), {"is_weight_mean": 0.8}),
        (
            LossConfig(policy_loss="gspo", is_mode="sequence_mask", beta=0.1),
            {"ref_logprobs": torch.zeros(1, 6)},
        ),
    ],
)
def test_the_declared_keys_are_the_keys_the_loss_returns(config, kwargs):
    assert set(_call(config, **kwargs)) == set(METRIC_KEYS)


def test_ranks_reduce_by_the_rule_micro_batches_merge_by(monkeypatch):
    # a second rank, faked at the collective: it contributes `peer` under the op it is asked for
    config = LossConfig(is_mode="token_truncate", beta=0.0)
    mine, peer = _call(config), _call(config, shift=0.4)
    seen = []

    def all_reduce(values, op="sum", group=None):
        theirs = torch.stack([peer[k].double() for k in keys_by_reduction(peer)[op]])
        values.copy_({"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op](values, theirs))
        seen.append(op)
        return values

    monkeypatch.setattr(update_module.distributed, "all_reduce", all_reduce)
    reduced = update_module.reduce_metrics(mine, None)
    assert seen == ["sum", "max", "min"]
    expected = finalize_metrics(merge_metrics(mine, peer))
    assert reduced == pytest.approx(expected)
    assert reduced["is/weight/min"] == pytest.approx(
        min(float(mine["is/weight/min"]), float(peer["is/weight/min"]))
    )
    assert reduced["is/weight/max"] == pytest.approx(
        max(float(mine["is/weight/max"]), float(peer["is/weight/max"]))
    )
