import pytest
import torch
from test_loss import cfg, run

from interlens_mcore.grpo.loss.aggregation import aggregate, broadcast, unit_means, unit_sums

# On-policy, the fixture's per-token losses are -A = [-2, -2, -2 | 1, 1] (samples of 3 and 2).


@pytest.mark.parametrize(
    "aggregation, extra, expected",
    [
        ("token-sum", {}, -4.0),  # -6 + 2, no denominator
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 4.0}, -0.5),  # -4 / (2 sequences * 4)
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 8.0}, -0.25),  # the constant, not T
    ],
)
def test_new_aggregations(aggregation, extra, expected):
    # num_tokens is deliberately odd: neither mode may read it
    loss, grad, _ = run(cfg(aggregation=aggregation, **extra), num_tokens=7)
    assert loss == pytest.approx(expected)
    scale = {"token-sum": 1.0}.get(aggregation, 1 / (2 * extra.get("loss_scale_factor", 1.0)))
    assert grad[:5] == pytest.approx([-2 * scale] * 3 + [scale] * 2)


def test_norm_mode_needs_its_constant():
    with pytest.raises(ValueError, match="LossConfig.loss_scale_factor"):
        cfg(aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="LossConfig.loss_scale_factor"):
        cfg(loss_scale_factor=0.0)
    with pytest.raises(ValueError, match="mode"):
        ids = torch.zeros(1, 1, dtype=torch.long)
        aggregate(torch.zeros(1, 1), ids >= 0, ids, 1, mode="token-max", num_tokens=1, num_sequences=1)


def test_unit_sums_ignore_padding_and_nonfinite_outside_where():
    values = torch.tensor([[1.0, 2.0, float("nan"), 4.0, float("inf")]])
    where = torch.tensor([[True, True, False, True, True]])
    ids = torch.tensor([[0, 0, 0, 1, -1]])  # the inf sits on padding
    assert unit_sums(values, where, ids, 2).tolist() == [3.0, 4.0]
    means, counts = unit_means(values, where, ids, 3)  # unit 2 is empty: mean 0
    assert means.tolist() == [1.5, 4.0, 0.0] and counts.tolist() == [2.0, 1.0, 0.0]
    assert broadcast(means, ids, fill=-1.0).tolist() == [[1.5, 1.5, 1.5, 4.0, -1.0]]
