import math

import pytest
import torch
from test_loss import ADV, LP, MASK, ROLLOUT, SAMPLE, cfg, fixture_batch, prepass_run, run

from interlens_mcore.grpo.loss.is_weights import importance_weights, off_policy_sequence_mask, rejection_mask
from interlens_mcore.grpo.loss.mask import is_weight_sums, loss_token_mask
from interlens_mcore.grpo.loss.metrics import finalize_metrics
from interlens_mcore.grpo.loss.objective import batch_loss

LN2 = math.log(2)
# The fixture of test_loss: sample 0 (A = 2) is complete with log(pi_train / pi_rollout) =
# [ln 4, -ln 2, 0] (token ratios [4, 0.5, 1]); sample 1 (A = -1) is not. On-policy the loss is
# (sum over sample 0 of w * -2 + 1 + 1) / 5 for IS weights w.


@pytest.mark.parametrize(
    "mode, low, weights, truncated, masked",
    [
        ("token_truncate", 0.8, [2, 0.8, 1], 2, 0),  # 4 -> 2 and 0.5 -> 0.8
        ("token_mask", 0.8, [0, 0, 1], 0, 2),  # 4 > 2 and 0.5 < 0.8 both dropped (IcePop)
        ("token_mask", 0.4, [0, 0.5, 1], 0, 1),
        ("sequence_mask", 1.3, [0, 0, 0], 0, 3),  # geometric mean 2^(1/3) = 1.26 < 1.3
    ],
)
def test_two_sided_weights(mode, low, weights, truncated, masked):
    loss, _, m = run(cfg(is_mode=mode, is_threshold=2.0, is_threshold_low=low))
    assert loss == pytest.approx((sum(w * -2 for w in weights) + 2) / 5, abs=1e-6)
    assert m["is/tokens_truncated"].item() == truncated and m["is/tokens_masked"].item() == masked


@pytest.mark.parametrize(
    "mode, threshold, weights",
    [
        ("sequence_truncate", 3.0, [2, 2, 2]),  # exp(ln 4 - ln 2 + 0) = 2: the product of [4, 0.5, 1]
        ("sequence_truncate", 1.5, [1.5, 1.5, 1.5]),
        ("sequence_mask", 1.5, [0, 0, 0]),
        ("turn_truncate", 3.0, [2, 2, 1]),  # turn 0: 4 * 0.5 = 2; turn 1: 1
    ],
)
def test_product_form_sequence_weight(mode, threshold, weights):
    loss, _, m = run(cfg(is_mode=mode, is_threshold=threshold, is_sequence_weight="product"))
    assert loss == pytest.approx((sum(w * -2 for w in weights) + 2) / 5, abs=1e-6)
    assert m["is/weight_sum"].item() == pytest.approx(sum(weights), abs=1e-5)


def test_product_form_log_weight_is_clamped():
    # 3 tokens of d = 15: the product's log is 45, clamped to 20 (e^45 overflows nothing in
    # float32, but e^90 in the chi-square would); the geometric mean is e^15.
    d = torch.full((1, 3), 15.0)
    ones = torch.ones(1, 3, dtype=torch.bool)
    ids = torch.zeros(1, 3, dtype=torch.long)
    w, _, _ = importance_weights(d, ones, mode="sequence_truncate", threshold=1e30, group_ids=ids,
                                 sequence_weight="product", clamp=20.0)  # fmt: skip
    assert w[0].tolist() == pytest.approx([math.exp(20)] * 3, rel=1e-5)
    with pytest.raises(ValueError, match="form"):
        importance_weights(d, ones, mode="sequence_mask", threshold=2.0, group_ids=ids, sequence_weight="sum")


def test_batch_normalization_to_mean_one():
    # token_truncate at 2: w = [2, 0.5, 1] on the 3 corrected tokens, mean 3.5 / 3 = 7 / 6.
    config = cfg(is_mode="token_truncate", is_batch_normalize=True)
    batch = fixture_batch()
    total, count = is_weight_sums(batch, LP, loss_token_mask(batch, LP, config), config).tolist()
    assert (total, count) == pytest.approx((3.5, 3.0))
    # w / (7 / 6) = [12/7, 3/7, 6/7], which sum to 3: the loss is (-2 * 3 + 2) / 5 = -0.8, as if
    # uncorrected in total, but distributed by the ratios.
    loss, grad, m = run(config, is_weight_mean=total / count)
    assert loss == pytest.approx(-0.8, abs=1e-6)
    assert grad[:3] == pytest.approx([-2 * w / 5 for w in (12 / 7, 3 / 7, 6 / 7)], abs=1e-6)
    assert m["is/weight_sum"].item() == pytest.approx(3.0, abs=1e-5)
    with pytest.raises(ValueError, match="is_weight_mean"):
        run(config)  # the mean is the batch's, so the caller must pass it
    with pytest.raises(ValueError, match="is_batch_normalize"):
        cfg(is_batch_normalize=True)  # is_mode 'none'


@pytest.mark.parametrize(
    "rule, threshold, low, rejected",
    [
        ("token", 2.0, None, [True, False, False]),  # ratios [4, 0.5, 1] vs [1/2, 2]: 4 out
        ("token", 2.0, 0.6, [True, True, False]),  # 0.5 < 0.6 too
        ("token", 5.0, None, [False, False, False]),
        ("sequence", 1.2, None, [True] * 3),  # geometric mean 2^(1/3) = 1.26 > 1.2
        ("sequence", 1.3, None, [False] * 3),
        ("sequence_k1", 0.2, None, [True] * 3),  # |mean(-d)| = ln 2 / 3 = 0.231 > 0.2
        ("sequence_k1", 0.25, None, [False] * 3),
        # k3 per token e^d - 1 - d: [3 - 2 ln 2, ln 2 - 0.5, 0], mean (2.5 - ln 2) / 3 = 0.6023
        ("sequence_k3", 0.6, None, [True] * 3),
        ("sequence_k3", 0.61, None, [False] * 3),
    ],
)
def test_rejection_rules(rule, threshold, low, rejected):
    d = torch.tensor([[2 * LN2, -LN2, 0.0, 0.0, 0.0, 0.0]])
    compared = torch.tensor([[True, True, True, False, False, False]])
    sample = torch.tensor([[0, 0, 0, 1, 1, -1]])
    out = rejection_mask(d, compared, sample, rule=rule, threshold=threshold, threshold_low=low)
    assert out[0].tolist() == rejected + [False] * 3  # sample 1 was not compared: never rejected


def test_rejected_tokens_leave_both_denominators():
    # token rule at 2: token 0 (ratio 4) goes. The pre-pass counts 4 tokens, 2 sequences:
    # token-mean (-2 - 2 + 1 + 1) / 4 = -0.5 (counting it, the loss-mask denominator gives -2 / 5).
    config = cfg(rejection="token", rejection_threshold=2.0)
    loss, grad, m, counts = prepass_run(config, fixture_batch())
    assert counts == (4.0, 2.0)
    assert loss == pytest.approx(-0.5) and grad[0] == 0.0
    assert m["is/tokens_rejected"].item() == 1 and m["tokens_kept"].item() == 4
    assert m["is/tokens_compared"].item() == 3  # diagnostics still see the rejected token
    # sequence rule at 1.2: sample 0 goes whole: 2 tokens, 1 sequence. token-mean (1 + 1) / 2 = 1;
    # seq-mean-token-sum 2 / 1 = 2.
    for aggregation, expected in (("token-mean", 1.0), ("seq-mean-token-sum", 2.0)):
        config = cfg(rejection="sequence", rejection_threshold=1.2, aggregation=aggregation)
        loss, grad, m, counts = prepass_run(config, fixture_batch())
        assert counts == (2.0, 1.0) and loss == pytest.approx(expected)
        assert grad[:3] == [0.0, 0.0, 0.0] and m["is/tokens_rejected"].item() == 3


def test_rejection_decided_in_the_call_without_a_prepass():
    # Same rule, no token_mask: the token still leaves the loss (and the metrics say so), but
    # the caller's denominators are used as given: (-2 - 2 + 1 + 1) / 5.
    loss, grad, m = run(cfg(rejection="token", rejection_threshold=2.0))
    assert loss == pytest.approx(-0.4) and grad[0] == 0.0
    assert m["is/tokens_rejected"].item() == 1


def test_off_policy_sequence_mask():
    # Sample 1 made complete with log(pi_train / pi_rollout) = [-0.5, -0.3]: mean(-d) = 0.4.
    rollout = ROLLOUT.clone()
    rollout[0, 3:5] = LP[0, 3:5] + torch.tensor([0.5, 0.3])
    complete = torch.tensor([True, True])
    # delta 0.3: sample 1 (A = -1) is masked; sample 0 (mean(-d) = -ln 2 / 3 < 0.3, and A > 0)
    # stays. Pre-pass: 3 tokens, 1 sequence; token-mean -6 / 3 = -2.
    config = cfg(off_policy_sequence_mask_delta=0.3)
    loss, grad, m, counts = prepass_run(config, fixture_batch(rollout=rollout, complete=complete))
    assert counts == (3.0, 1.0) and loss == pytest.approx(-2.0)
    assert grad[3:5] == [0.0, 0.0] and m["is/tokens_rejected"].item() == 2
    # delta 0.5 > 0.4: nothing masked, the usual -0.8
    config = cfg(off_policy_sequence_mask_delta=0.5)
    loss, _, _, counts = prepass_run(config, fixture_batch(rollout=rollout, complete=complete))
    assert counts == (5.0, 2.0) and loss == pytest.approx(-0.8)
    # a positive advantage keeps a drifted sample: A = +1 on sample 1
    adv = ADV.clone()
    adv[0, 3:5] = 1.0
    d = torch.where(MASK, LP - rollout, 0.0)  # [2 ln 2, -ln 2, 0 | -0.5, -0.3]
    assert off_policy_sequence_mask(d, MASK, SAMPLE, ADV, 0.3)[0].tolist() == [False] * 3 + [True] * 2 + [
        False
    ]
    assert not off_policy_sequence_mask(d, MASK, SAMPLE, adv, 0.3).any()


def test_rejection_config_validation():
    for kwargs, name in [
        ({"rejection": "token"}, "rejection_threshold"),  # needs a threshold
        ({"rejection": "token", "rejection_threshold": 0.5}, "rejection_threshold_low"),  # 2 > 0.5
        (
            {"rejection": "sequence_k3", "rejection_threshold": 1.0, "rejection_threshold_low": 0.1},
            "rejection_threshold_low",
        ),
        ({"rejection_threshold": 2.0}, "rejection_threshold"),  # a threshold with no rule
        ({"rejection": "tokens", "rejection_threshold": 2.0}, "rejection"),
        ({"off_policy_sequence_mask_delta": -0.1}, "off_policy_sequence_mask_delta"),
        ({"is_mode": "token_mask", "is_threshold_low": 3.0}, "is_threshold_low"),
        ({"is_sequence_weight": "sum"}, "is_sequence_weight"),
    ]:
        with pytest.raises(ValueError, match=f"LossConfig.{name}"):
            cfg(**kwargs)


def test_batch_loss_mask_and_denominators_agree_on_nonfinite_rollout():
    # A NaN rollout logprob of a complete sample drops that token in the pre-pass and the loss.
    rollout = ROLLOUT.clone()
    rollout[0, 2] = math.nan
    batch = fixture_batch(rollout=rollout)
    config = cfg(is_mode="token_truncate")
    mask = loss_token_mask(batch, LP, config)
    assert mask[0].tolist() == [True, True, False, True, True, False]
    loss, m = batch_loss(LP, batch, config, token_mask=mask, num_tokens=4, num_sequences=2)
    # w [2, 0.5] on tokens 0-1: (-4 - 1 + 1 + 1) / 4 = -0.75
    assert loss.item() == pytest.approx(-0.75) and m["nonfinite_masked"].item() == 1


def huge_pair_run(config):
    # one sample of two tokens with log(pi_train / pi_rollout) = [+41, -38]: the product is e^3
    lp = torch.tensor([[-1.0, -39.0]])
    return finalize_metrics(
        run(
            config,
            lp=lp,
            loss_mask=torch.ones(1, 2, dtype=torch.bool),
            advantages=torch.ones(1, 2),
            rollout_logprobs=torch.tensor([[-42.0, -1.0]]),
            logprobs_complete=torch.tensor([True]),
            sample_ids=torch.zeros(1, 2, dtype=torch.long),
            segment_ids=torch.zeros(1, 2, dtype=torch.long),
            num_tokens=2,
            num_sequences=1,
        )[2]
    )


def test_product_weight_sums_the_unclamped_log_ratios_then_clamps():
    # Sum first (41 - 38 = 3), then bound to +-20: e^3, as verl and TRL have it. Clamping each
    # token first (+20 - 20) gave 1.0. chi2_seq bounds the same sum: rho^2 - 1 = e^6 - 1.
    product = cfg(is_mode="sequence_truncate", is_threshold=1e9, is_sequence_weight="product")
    out = huge_pair_run(product)
    assert out["is/weight_mean"] == pytest.approx(math.exp(3), rel=1e-6)
    assert out["is/chi2_seq"] == pytest.approx(math.exp(6) - 1, rel=1e-6)
    assert out["is/chi2_seq"] + 1 == pytest.approx(out["is/weight_mean"] ** 2, rel=1e-6)  # the same rho
    truncated = huge_pair_run(
        cfg(is_mode="sequence_truncate", is_threshold=1.5, is_sequence_weight="product")
    )
    assert out["is/weight_std"] == 0.0 and truncated["is/weight_mean"] == pytest.approx(1.5)
    # the geometric form averages the clamped token log-ratios (verl's and ms-swift's geometric
    # rule): (20 - 20) / 2 = 0, weight 1
    geometric = huge_pair_run(cfg(is_mode="sequence_truncate", is_threshold=1e9))
    assert geometric["is/weight_mean"] == pytest.approx(1.0)
    # the turn modes share the rule; a sum beyond the bound is still bounded (41 + 41 -> 20)
    d = torch.tensor([[41.0, 41.0]], dtype=torch.float64)
    ones, ids = torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.long)
    w, _, _ = importance_weights(d, ones, mode="turn_truncate", threshold=1e30, group_ids=ids,
                                 sequence_weight="product", clamp=20.0)  # fmt: skip
    assert w[0].tolist() == pytest.approx([math.exp(20)] * 2, rel=1e-6)


def test_product_weight_prepass_mean_agrees():
    # is_weight_sums (the batch mean for is_batch_normalize) uses the same rule: e^3 on 2 tokens
    config = cfg(is_mode="sequence_truncate", is_threshold=1e9, is_sequence_weight="product")
    batch = fixture_batch(rollout=torch.tensor([[-42.0, -1.0, -1.0, math.nan, math.nan, 0.0]]))
    lp = torch.tensor([[-1.0, -39.0, -1.0, -1.0, -1.0, -1.0]])
    total, count = is_weight_sums(batch, lp, loss_token_mask(batch, lp, config), config).tolist()
    assert count == 3 and total == pytest.approx(3 * math.exp(3), rel=1e-6)


def test_asymmetric_token_bounds_are_the_inverse_of_verl_lo_hi():
    # ours: keep lo <= pi_train / pi_rollout <= hi. verl's token_k1 "lo_hi" keeps
    # lo <= pi_rollout / pi_train <= hi. So our (hi 1.5, lo 0.8) keeps exactly the tokens that
    # verl's "0.667_1.25" (1 / 1.5, 1 / 0.8) keeps.
    ratios = torch.tensor([0.7, 0.79, 0.81, 1.0, 1.24, 1.26, 1.49, 1.51])
    d = torch.log(ratios)[None]
    compared, ids = torch.ones_like(d, dtype=torch.bool), torch.zeros_like(d, dtype=torch.long)
    ours = ~rejection_mask(d, compared, ids, rule="token", threshold=1.5, threshold_low=0.8)
    k1 = -d  # log(pi_rollout / pi_train), verl's token_k1 statistic
    verl_kept = (k1 >= math.log(1 / 1.5)) & (k1 <= math.log(1 / 0.8))
    assert ours.tolist() == verl_kept.tolist() == [[False, False, True, True, True, True, True, False]]


def test_off_policy_sequence_mask_equals_trl():
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    g = torch.Generator().manual_seed(0)
    rows, length = 12, 7
    train = -torch.rand(rows, length, generator=g) * 3
    rollout = train + torch.randn(rows, length, generator=g) * 0.4
    mask = torch.rand(rows, length, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(rows, 1, generator=g)
    ids = torch.arange(rows)[:, None].expand(rows, length).clone()
    # 5 of the 12 samples have A < 0; of them 2, 1 and 0 drifted past delta
    for delta, dropped in ((0.0, 2), (0.05, 1), (0.2, 0)):
        keep = trl_grpo.GRPOTrainer.get_off_policy_mask(adv, train, rollout, mask.float(), delta)
        d = torch.where(mask, train - rollout, 0.0)
        ours = off_policy_sequence_mask(d, mask, ids, adv.expand(rows, length), delta)
        assert ours.tolist() == (mask & (keep == 0)).tolist()
        assert int((keep == 0).sum()) == dropped


def test_batch_normalization_mean_is_over_tokens_in_sequence_modes():
    # Both samples complete: sample 0 (3 tokens) has product weight 2, sample 1 (2 tokens, d =
    # [ln 2, ln 2]) weight 4. The mean is over corrected tokens, (3 * 2 + 2 * 4) / 5 = 2.8, not
    # verl's mean over sequences (2 + 4) / 2 = 3.
    rollout = ROLLOUT.clone()
    rollout[0, 3:5] = LP[0, 3:5] - LN2
    batch = fixture_batch(rollout=rollout, complete=torch.tensor([True, True]))
    config = cfg(
        is_mode="sequence_truncate", is_threshold=10.0, is_sequence_weight="product", is_batch_normalize=True
    )
    total, count = is_weight_sums(batch, LP, loss_token_mask(batch, LP, config), config).tolist()
    assert count == 5 and total / count == pytest.approx(2.8, rel=1e-6)
