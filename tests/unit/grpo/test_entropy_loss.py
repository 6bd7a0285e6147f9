"""The entropy bonus (`entropy_coeff`) and the top-entropy token mask (`top_entropy_quantile`) in the loss."""

import pytest
import torch
from test_loss import LP, cfg, run
from test_named_losses import TRL_ADV, TRL_LP, TRL_MASK, TRL_OLD, ours
from trl_reference import trl_loss

from trainers.update import top_entropy_masks

# an entropy per position of test_loss's row (position 5 is padding and must not count)
H = torch.tensor([[0.5, 1.5, 2.0, 0.1, 3.0, 9.0]])


def test_entropy_bonus_value_and_gradient():
    # on-policy token-mean policy loss: -A summed / 5 = (-6 + 2) / 5 = -0.8. Bonus 0.1 x the
    # entropy's token-mean over the five loss tokens: 0.1 x 7.1 / 5.
    h = H.clone().requires_grad_(True)
    loss, grad, _ = run(cfg(entropy_coeff=0.1), entropy=h)
    assert loss == pytest.approx(-0.8 - 0.1 * 7.1 / 5, abs=1e-6)
    assert h.grad[0].tolist() == pytest.approx([-0.02] * 5 + [0.0])  # -C / num_tokens, 0 on padding
    base_loss, base_grad, _ = run(cfg())
    assert grad == pytest.approx(base_grad)  # the logprobs' gradient is the policy loss's
    # the policy loss's aggregation: seq-mean-token-mean averages each sample's entropies first
    loss, _, _ = run(cfg(entropy_coeff=0.1, aggregation="seq-mean-token-mean"), entropy=H)
    assert loss == pytest.approx(-0.5 - 0.1 * (4.0 / 3 + 3.1 / 2) / 2, abs=1e-6)


def test_entropy_off_is_the_plain_loss_and_the_entropy_is_required_on():
    plain, grad, _ = run(cfg())
    given, grad_given, _ = run(cfg(), entropy=H)  # coefficient 0: the entropy is not read
    assert plain == given and grad == grad_given
    with pytest.raises(ValueError, match="entropy .* required when LossConfig.entropy_coeff"):
        run(cfg(entropy_coeff=0.1))
    with pytest.raises(ValueError, match="LossConfig.entropy_coeff"):
        cfg(entropy_coeff=-0.1)
    with pytest.raises(ValueError, match="LossConfig.top_entropy_quantile"):
        cfg(top_entropy_quantile=0.0)


def test_entropy_mask_removes_the_policy_loss_but_not_the_denominators():
    # tokens 1, 2, 4 keep the policy loss: -A = -2, -2, 1; sum -3, still / 5
    keep = torch.tensor([[False, True, True, False, True, False]])
    loss, grad, m = run(cfg(), entropy_mask=keep)
    assert loss == pytest.approx(-3 / 5, abs=1e-6)
    assert grad[:5] == pytest.approx([0.0, -0.4, -0.4, 0.0, 0.2], abs=1e-6)
    assert m["tokens_kept"].item() == 5  # the masked tokens are still loss tokens
    # the KL term still covers every kept token: its gradient reaches the masked ones
    ref = LP - 0.5
    _, grad, _ = run(cfg(beta=0.1), entropy_mask=keep, ref_logprobs=ref)
    assert grad[0] != 0.0 and grad[3] != 0.0


def test_top_entropy_masks_one_process():
    mask = torch.tensor([[True, True, True, True, True, False]])
    # q = 0.4 of the five loss entropies [0.5, 1.5, 2, 0.1, 3]: threshold the 0.6 quantile,
    # sorted [0.1, 0.5, 1.5, 2, 3] at position 2.4: 1.5 + 0.4 x 0.5 = 1.7 -> tokens 2 and 4
    (high,), masked = top_entropy_masks([mask], [H], 0.4, None)
    assert high[0].tolist() == [False, False, True, False, True, False]
    assert masked == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="top-entropy-quantile"):
        top_entropy_masks([mask], [None], 0.4, None)


def _masks_worker(rank, world_size):
    import torch

    mask = torch.ones(1, 3, dtype=torch.bool)
    # rank 0 holds [0, 1, 2], rank 1 [3, 4, 5] and an empty micro-batch: the union's 0.5
    # quantile is 2.5, so rank 0 keeps nothing and rank 1 all three
    h = torch.arange(3.0)[None] + 3 * rank
    masks = [mask] if rank == 0 else [mask, None]
    entropies = [h] if rank == 0 else [h, None]
    out, masked = top_entropy_masks(masks, entropies, 0.5, None)
    return [None if o is None else o.tolist() for o in out], masked


def test_top_entropy_threshold_spans_the_dp_ranks():
    from support.dist import run_ranks

    (r0, m0), (r1, m1) = run_ranks(_masks_worker, 2, timeout=120)
    assert r0 == [[[False, False, False]]] and r1 == [[[True, True, True]], None]
    assert m0 == m1 == pytest.approx(0.5)


TRL_H = torch.tensor([[0.3, 2.0, 1.1, 0.7], [1.9, 0.2, 2.5, 0.9], [1.4, 0.6, 5.0, 5.0]])


@pytest.mark.parametrize("quantile", [0.5, 0.2])
def test_top_entropy_quantile_equals_trl(quantile):
    # TRL's 'grpo' (each sequence's mean, then the mean): our seq-mean-token-mean
    lp = TRL_LP + torch.tensor([0.4, 0.0, -0.3, 0.0])
    (high,), _ = top_entropy_masks([TRL_MASK], [TRL_H], quantile, None)
    config = cfg(aggregation="seq-mean-token-mean", top_entropy_quantile=quantile)
    loss, grad, _ = ours(config, lp, entropy_mask=high)
    leaf = lp.clone().requires_grad_(True)
    ref = trl_loss("grpo", leaf, TRL_OLD, TRL_ADV, TRL_MASK, entropies=TRL_H, top_entropy_quantile=quantile)
    ref.backward()
    assert loss == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(grad, leaf.grad * TRL_MASK, atol=1e-6)


def test_entropy_bonus_equals_trl():
    # TRL's bonus is the entropy's token-mean over the loss tokens, whatever the loss type;
    # with its 'bnpo' (the token-mean loss) it is our token-mean entropy_coeff
    h = TRL_H.clone().requires_grad_(True)
    loss, grad, _ = ours(cfg(entropy_coeff=0.05), TRL_LP, entropy=h)
    h_ref = TRL_H.clone().requires_grad_(True)
    leaf = TRL_LP.clone().requires_grad_(True)
    ref = trl_loss("bnpo", leaf, TRL_OLD, TRL_ADV, TRL_MASK, entropies=h_ref, entropy_coef=0.05)
    ref.backward()
    assert loss == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(grad, leaf.grad * TRL_MASK, atol=1e-6)
    assert torch.allclose(h.grad, h_ref.grad * TRL_MASK, atol=1e-7)
