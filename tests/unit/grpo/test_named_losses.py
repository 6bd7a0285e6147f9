"""The policy losses users ask for by name: sapo, cispo_seq, geo_mean, clip_cov, kl_cov."""

import math

import pytest
import torch
from test_loss import LP, cfg, ratios_old, run
from trl_reference import trl_loss

from interlens_mcore.grpo.loss.objective import grpo_loss
from interlens_mcore.grpo.loss.policy import POLICY_LOSSES, PolicyInputs

# test_loss's fixture: samples 0 (tokens 0-2, A = 2) and 1 (tokens 3-4, A = -1), every train
# logprob -1; these old logprobs make the token ratios [4, 0.5, 1 | 2, 0.5].
RATIOS = [4.0, 0.5, 1.0, 2.0, 0.5]
OLD = ratios_old(RATIOS)
ADV = [2.0, 2.0, 2.0, -1.0, -1.0]


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_sapo_value_and_gradient():
    # per token -A (4 / tau) sigmoid(tau (r - 1)), tau 1 for A > 0, 1.05 for A < 0; token-mean / 5.
    # d/dlp = -A (4 / tau) tau s (1 - s) r = -4 A s (1 - s) r.
    taus = [1.0, 1.0, 1.0, 1.05, 1.05]
    values, grads = [], []
    for a, r, tau in zip(ADV, RATIOS, taus):
        s = sigmoid(tau * (r - 1))
        values.append(-a * 4 / tau * s)
        grads.append(-4 * a * s * (1 - s) * r / 5)
    loss, grad, m = run(cfg(policy_loss="sapo"), old_logprobs=OLD)
    assert loss == pytest.approx(sum(values) / 5, abs=1e-6)
    assert grad[:5] == pytest.approx(grads, abs=1e-6)
    assert m["clip/tokens_clipped"].item() == 0 and m["ratio/max"].item() == pytest.approx(4.0)
    # the temperatures are read: tau_neg 2 changes sample 1's tokens only
    _, grad2, _ = run(cfg(policy_loss="sapo", sapo_temperature_neg=2.0), old_logprobs=OLD)
    assert grad2[:3] == pytest.approx(grad[:3]) and grad2[3] != pytest.approx(grad[3])


def test_sapo_on_policy_gradient_is_ppos():
    # r = 1: sigmoid 1/2, the slope 4 s (1 - s) = 1: the gradient -A / 5 of vanilla
    _, grad, _ = run(cfg(policy_loss="sapo"))
    _, ref, _ = run(cfg())
    assert grad == pytest.approx(ref, abs=1e-7)


def test_cispo_seq_weights_every_token_with_the_sequence_ratio():
    # s = [2^(1/3) = 1.26 (capped at 1.2) x3 | 1 x2]; per token -A w lp = A w:
    # [2.4, 2.4, 2.4, -1, -1], sum 5.2, / 5 = 1.04; gradient -A w / 5.
    loss, grad, m = run(cfg(policy_loss="cispo_seq"), old_logprobs=OLD)
    assert loss == pytest.approx(1.04, abs=1e-6)
    assert grad[:5] == pytest.approx([-0.48] * 3 + [0.2, 0.2], abs=1e-6)
    assert m["clip/tokens_clipped"].item() == 3
    _, grad, m = run(cfg(policy_loss="cispo_seq", epsilon_high=0.3), old_logprobs=OLD)
    assert grad[:3] == pytest.approx([-0.4 * 2 ** (1 / 3)] * 3, abs=1e-6)
    assert m["clip/tokens_clipped"].item() == 0


def test_geo_mean_value_and_gradient():
    # eps 0.2 in log space. Sample 0 (A = 2 > 0): d = [ln 4, -ln 2, 0] capped above at 0.2:
    # [0.2, -ln 2, 0]; R0 = exp(mean). Sample 1 (A = -1): d = [ln 2, -ln 2] floored at -0.2:
    # [ln 2, -0.2]; R1 = exp(mean). seq-mean-token-mean: (-2 R0 + R1) / 2.
    ln2 = math.log(2)
    r0 = math.exp((0.2 - ln2) / 3)
    r1 = math.exp((ln2 - 0.2) / 2)
    loss, grad, m = run(cfg(policy_loss="geo_mean", aggregation="seq-mean-token-mean"), old_logprobs=OLD)
    assert loss == pytest.approx((-2 * r0 + r1) / 2, abs=1e-6)
    # d/dlp_t of -A R = -A R / n on unclipped tokens, then / 2 sequences; clipped tokens 0 and 4: 0
    assert grad[:5] == pytest.approx([0, -r0 / 3, -r0 / 3, r1 / 4, 0], abs=1e-6)
    assert m["clip/tokens_clipped"].item() == 2
    # token-mean: each token holds its sequence's -A R, so sample 0 weighs 3 / 5
    loss, _, _ = run(cfg(policy_loss="geo_mean"), old_logprobs=OLD)
    assert loss == pytest.approx((3 * -2 * r0 + 2 * r1) / 5, abs=1e-6)


def inputs(lp, old, adv):
    lp = torch.tensor([lp], requires_grad=True)
    x = PolicyInputs(
        logprobs=lp,
        old_logprobs=torch.tensor([old]),
        advantages=torch.tensor([adv]),
        valid=torch.ones(1, len(adv), dtype=torch.bool),
        sample_ids=torch.arange(len(adv))[None],
        num_samples=len(adv),
    )
    return lp, x


# A = [1, 1, -1, -1] (mean 0), lp = [-0.5, -4.5, -2.5, -0.5] (mean -2): the covariances
# A (lp + 2) are [1.5, -2.5, 0.5, -1.5]; only token 0 lies in clip_cov's (1, 5).
LPS, ADVS = [-0.5, -4.5, -2.5, -0.5], [1.0, 1.0, -1.0, -1.0]


def test_clip_cov_drops_the_high_covariance_token():
    lp, x = inputs(LPS, LPS, ADVS)
    terms = POLICY_LOSSES["clip_cov"](x, cfg(clip_cov_ratio=1.0))
    # on-policy -A r = -A, token 0 dropped (value and gradient 0) though the ratio allows 4 tokens
    assert terms.per_token[0].tolist() == pytest.approx([0.0, -1.0, 1.0, 1.0])
    terms.per_token.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, -1.0, 1.0, 1.0])
    assert terms.clipped[0].tolist() == [True, False, False, False]
    # a token PPO's clip already acted on is no candidate: r = 2 on token 0 (A > 0) is clipped
    lp, x = inputs(LPS, [-0.5 - math.log(2)] + LPS[1:], ADVS)
    terms = POLICY_LOSSES["clip_cov"](x, cfg(clip_cov_ratio=1.0))
    assert terms.per_token[0].tolist() == pytest.approx([-1.2, -1.0, 1.0, 1.0])


def test_clip_cov_draws_ratio_times_tokens_the_same_way_each_time():
    # lp = [-0.5, -0.5, -4.5, -2.5], A = [1, 1, 1, -3]: mean A 0, mean lp -2, covariances
    # [1.5, 1.5, -2.5, 1.5]: three candidates; ratio 0.25 of 4 tokens: exactly one dropped.
    lps, advs = [-0.5, -0.5, -4.5, -2.5], [1.0, 1.0, 1.0, -3.0]
    picks = []
    for _ in range(2):
        _, x = inputs(lps, lps, advs)
        terms = POLICY_LOSSES["clip_cov"](x, cfg(clip_cov_ratio=0.25))
        picks.append(terms.clipped[0].tolist())
    assert sum(picks[0]) == 1 and not picks[0][2] and picks[0] == picks[1]


def test_kl_cov_penalises_the_top_covariance_token_without_clipping():
    # old makes token 0's ratio 2 (d = ln 2, A = 1; vanilla would clip it); it has the top
    # covariance 1.5: -A r + coef |d| = -2 + 0.5 ln 2, gradient -A r + coef sign(d) = -1.5.
    lp, x = inputs(LPS, [-0.5 - math.log(2)] + LPS[1:], ADVS)
    terms = POLICY_LOSSES["kl_cov"](x, cfg(kl_cov_ratio=0.25, ppo_kl_coef=0.5))
    assert terms.per_token[0].tolist() == pytest.approx([-2 + 0.5 * math.log(2), -1.0, 1.0, 1.0])
    terms.per_token.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.5, -1.0, 1.0, 1.0])
    assert terms.clipped[0].tolist() == [True, False, False, False]
    # ratio 0.5: the top two, tokens 0 and 2 (covariance 0.5); token 2 is on-policy, |d| = 0
    terms = POLICY_LOSSES["kl_cov"](x, cfg(kl_cov_ratio=0.5, ppo_kl_coef=0.5))
    assert terms.clipped[0].tolist() == [True, False, True, False]


def test_named_losses_skip_nonfinite_tokens():
    lp = LP.clone()
    lp[0, 1] = math.nan
    for name in ("sapo", "cispo_seq", "geo_mean", "clip_cov", "kl_cov"):
        loss, grad, m = run(cfg(policy_loss=name), lp=lp, old_logprobs=OLD)
        assert math.isfinite(loss) and all(math.isfinite(g) for g in grad), name
        assert grad[1] == 0.0 and m["nonfinite_masked"].item() == 1, name


def test_bad_hyperparameters_name_the_field():
    for field, value in [
        ("sapo_temperature_pos", 0.0),
        ("sapo_temperature_neg", -1.0),
        ("clip_cov_ratio", 0.0),
        ("kl_cov_ratio", 1.5),
        ("ppo_kl_coef", -1.0),
    ]:
        with pytest.raises(ValueError, match=f"LossConfig.{field}"):
            cfg(**{field: value})
    with pytest.raises(ValueError, match="LossConfig.clip_cov_lb"):
        cfg(clip_cov_lb=5.0, clip_cov_ub=1.0)


# Padded rows for the TRL comparisons: three samples, the last with two padding slots.
TRL_LP = torch.tensor([[-0.3, -1.2, -2.0, -0.1], [-0.7, -0.4, -1.5, -0.9], [-2.2, -0.05, 0.0, 0.0]])
TRL_OLD = torch.tensor([[-0.5, -1.0, -2.4, -0.1], [-0.2, -0.9, -1.5, -1.3], [-1.9, -0.3, 0.0, 0.0]])
TRL_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
TRL_ADV = torch.tensor([1.3, -0.8, 0.4])


def ours(config, lp, **kwargs):
    lp = lp.clone().requires_grad_(True)
    b = lp.shape[0]
    ids = torch.where(TRL_MASK, torch.arange(b)[:, None], -1)
    loss, metrics = grpo_loss(
        lp,
        loss_mask=TRL_MASK,
        advantages=torch.where(TRL_MASK, TRL_ADV[:, None], 0.0),
        rollout_logprobs=TRL_OLD,
        logprobs_complete=torch.ones(b, dtype=torch.bool),
        sample_ids=ids,
        config=config,
        old_logprobs=TRL_OLD,
        num_tokens=int(TRL_MASK.sum()),
        num_sequences=b,
        **kwargs,
    )
    loss.backward()
    return loss.item(), lp.grad, metrics


def theirs(loss_type, lp, **kwargs):
    lp = lp.clone().requires_grad_(True)
    loss = trl_loss(loss_type, lp, TRL_OLD, TRL_ADV, TRL_MASK, **kwargs)
    loss.backward()
    return loss.item(), lp.grad * TRL_MASK


@pytest.mark.parametrize("pos,neg", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_equals_trl(pos, neg):
    # TRL's 'sapo' averages each sequence's tokens, then the sequences: our seq-mean-token-mean
    config = cfg(
        policy_loss="sapo",
        aggregation="seq-mean-token-mean",
        sapo_temperature_pos=pos,
        sapo_temperature_neg=neg,
    )
    loss, grad, _ = ours(config, TRL_LP)
    ref_loss, ref_grad = theirs("sapo", TRL_LP, sapo_temperature_pos=pos, sapo_temperature_neg=neg)
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    assert torch.allclose(grad, ref_grad, atol=1e-6)


@pytest.mark.parametrize("name,level", [("cispo", "token"), ("cispo_seq", "sequence")])
def test_cispo_equals_trl(name, level):
    # TRL's cispo sums the tokens over the batch's token count (our token-mean) and caps the
    # weight at epsilon_high itself: ours 0.3 is its 1.3. The old logprobs put some ratios above.
    config = cfg(policy_loss=name, epsilon_high=0.3)
    lp = TRL_LP + torch.tensor([0.4, 0.0, 0.0, 0.0])
    loss, grad, _ = ours(config, lp)
    ref_loss, ref_grad = theirs("cispo", lp, level=level, epsilon_high=1.3)
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    assert torch.allclose(grad, ref_grad, atol=1e-6)


@pytest.mark.parametrize("name", ["sapo", "cispo_seq", "geo_mean", "clip_cov", "kl_cov"])
def test_named_losses_packed_equal_padded(name):
    from interlens_mcore.grpo.batch import build_batch
    from interlens_mcore.grpo.loss.objective import batch_loss
    from interlens_mcore.types import Trajectory

    # logprobs from a table of (input id, target) pairs: both layouts read the same values. The
    # clip_cov bounds make every unclipped token a candidate, so its draw is compared too.
    torch.manual_seed(3)
    v = 9
    table = (-torch.rand(v, v) * 2).requires_grad_(True)
    shift = torch.randn(v, v) * 0.3
    ids = [[1, 4, 2, 7, 3], [2, 2, 5, 8], [6, 1, 3, 3, 0, 5]]
    masks = [[0, 1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 0, 1, 1]]
    ts = [Trajectory(token_ids=i, loss_mask=m, rollout_logprobs=None) for i, m in zip(ids, masks)]
    adv = [1.0, -0.5, 0.7]
    config = cfg(policy_loss=name, aggregation="seq-mean-token-mean", clip_cov_lb=-100.0, kl_cov_ratio=0.2)
    results = []
    for layout in ("packed", "padded"):
        b = build_batch(ts, adv, layout=layout)
        lp = table[b.input_ids, b.targets]
        old = (lp + shift[b.input_ids, b.targets]).detach()
        table.grad = None
        loss, m = batch_loss(lp, b, config, old_logprobs=old, num_tokens=10, num_sequences=3)
        loss.backward()
        results.append((loss.item(), table.grad.clone(), m["clip/tokens_clipped"].item()))
    (packed, g_packed, c_packed), (padded, g_padded, c_padded) = results
    assert packed == pytest.approx(padded, abs=1e-6) and c_packed == c_padded
    assert torch.allclose(g_packed, g_padded, atol=1e-6)
