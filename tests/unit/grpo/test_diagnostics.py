import math

import pytest
import torch
from test_loss import LP, ROLLOUT, cfg, ratios_old, run

from interlens_mcore.grpo.loss.metrics import empty_metrics, finalize_metrics, merge_metrics

LN2 = math.log(2)
# The fixture of test_loss: train logprobs -1; sample 0 (3 tokens) has rollout logprobs
# [-1 - 2 ln 2, -1 + ln 2, -1], so d = train - rollout = [ln 4, -ln 2, 0], token ratios
# w = [4, 0.5, 1], sequence ratio rho = exp(sum d) = 2. Sample 1 has no rollout logprobs.


def test_off_policy_diagnostics_by_hand():
    _, _, m = run(cfg(is_mode="token_truncate"))
    out = finalize_metrics(m)
    # perplexity per sample, averaged over samples: exp(-mean logprob)
    # rollout: mean = (-3 - 2 ln 2 + ln 2) / 3 = -1 - ln 2 / 3 -> e * 2^(1/3)
    assert out["is/rollout_ppl"] == pytest.approx(math.e * 2 ** (1 / 3), rel=1e-6)
    assert out["is/training_ppl"] == pytest.approx(math.e, rel=1e-6)
    # log ppl_train - log ppl_rollout = 1 - (1 + ln 2 / 3)
    assert out["is/log_ppl_diff"] == pytest.approx(-LN2 / 3, abs=1e-6)
    # chi-square E[w^2] - 1: tokens (16 + 0.25 + 1) / 3 - 1 = 4.75; sequence rho^2 - 1 = 3
    assert out["is/chi2_token"] == pytest.approx(4.75, rel=1e-6)
    assert out["is/chi2_seq"] == pytest.approx(3.0, rel=1e-6)
    # applied weights (truncated at 2) [2, 0.5, 1]: sum 3.5, sum of squares 5.25, n 3
    # ESS = 3.5^2 / (3 * 5.25) = 7 / 9; std = sqrt(5.25 / 3 - (3.5 / 3)^2) = sqrt(7 / 18)
    assert out["is/ess"] == pytest.approx(7 / 9, rel=1e-6)
    assert out["is/weight_std"] == pytest.approx(math.sqrt(7 / 18), rel=1e-5)
    assert out["is/weight/min"] == pytest.approx(0.5)
    assert out["is/weight/max"] == pytest.approx(2.0)
    assert out["is/abs_logprob_diff/max"] == pytest.approx(2 * LN2, rel=1e-6)
    assert out["ppo_kl"] == pytest.approx(0.0)  # one update: old is the train policy


def test_on_policy_diagnostics_are_neutral():
    rollout = ROLLOUT.clone()
    rollout[0, :3] = LP[0, :3]
    out = finalize_metrics(run(cfg(is_mode="sequence_truncate"), rollout_logprobs=rollout)[2])
    assert out["is/chi2_token"] == pytest.approx(0.0, abs=1e-6) and out["is/chi2_seq"] == pytest.approx(
        0.0, abs=1e-6
    )
    assert out["is/ess"] == pytest.approx(1.0) and out["is/weight_std"] == pytest.approx(0.0, abs=1e-6)
    assert out["is/log_ppl_diff"] == pytest.approx(0.0, abs=1e-6)
    assert out["is/rollout_ppl"] == pytest.approx(out["is/training_ppl"])


def test_ppo_kl():
    # old - lp = -log r with r = [1.5, 0.5, 1, 1.5, 0.5]: 2 ln 2 - 2 ln 1.5 = 2 ln(4 / 3), / 5 tokens
    out = finalize_metrics(run(cfg(), old_logprobs=ratios_old([1.5, 0.5, 1.0, 1.5, 0.5]))[2])
    assert out["ppo_kl"] == pytest.approx(2 * math.log(4 / 3) / 5, rel=1e-5)


def test_min_max_and_sums_merge_across_calls():
    _, _, a = run(cfg(is_mode="token_truncate"))  # weights [2, 0.5, 1]
    _, _, b = run(cfg(is_mode="token_truncate", is_threshold=5.0, is_threshold_low=0.75))  # [4, 0.75, 1]
    merged = merge_metrics(a, b)
    assert merged["is/weight/min"].item() == pytest.approx(0.5)  # min(0.5, 0.75), not a sum
    assert merged["is/weight/max"].item() == pytest.approx(4.0)
    assert merged["is/abs_logprob_diff/max"].item() == pytest.approx(2 * LN2)
    assert merged["is/weight_sq_sum"].item() == pytest.approx(5.25 + 16 + 0.5625 + 1, rel=1e-6)
    # a rank with nothing contributes the neutral element of every reduction
    alone = merge_metrics(a, empty_metrics())
    for key in a:
        torch.testing.assert_close(alone[key], a[key], msg=key)
    # figures over two calls come from the summed sums: ESS of [2, 0.5, 1, 4, 0.75, 1]
    out = finalize_metrics(merged)
    w = [2, 0.5, 1, 4, 0.75, 1]
    assert out["is/ess"] == pytest.approx(sum(w) ** 2 / (6 * sum(x * x for x in w)), rel=1e-6)


def test_no_correction_reports_zero_weight_figures():
    out = finalize_metrics(run(cfg())[2])
    assert out["is/weight/min"] == 0.0 and out["is/ess"] == 0.0 and out["is/weight_std"] == 0.0
    assert out["is/chi2_token"] == pytest.approx(4.75, rel=1e-6)  # the mismatch is still measured


def one_row(d, config, lp=-1.0):
    """`grpo_loss` metrics of one complete sample whose tokens have log(pi_train / pi_rollout) = d."""
    n = len(d)
    train = torch.full((1, n), lp)
    rollout = train - torch.tensor([d])
    _, _, m = run(
        config,
        lp=train,
        loss_mask=torch.ones(1, n, dtype=torch.bool),
        advantages=torch.ones(1, n),
        rollout_logprobs=rollout,
        logprobs_complete=torch.tensor([True]),
        sample_ids=torch.zeros(1, n, dtype=torch.long),
        segment_ids=torch.zeros(1, n, dtype=torch.long),
        num_tokens=n,
        num_sequences=1,
    )
    return m


def applied_weights(d):
    """The float32 weights the loss applies for log-ratios d (untruncated): exp in float64, rounded."""
    lp = torch.tensor(-1.0)
    exact = lp.double() - (lp - torch.tensor(d)).double()  # the float32 logprobs' difference
    return [float(w) for w in torch.exp(exact).float().double()]


@pytest.mark.parametrize("d", [0.123, 0.5, -2.0])
def test_weight_std_of_one_token_is_exactly_zero(d):
    # the old one-pass form sqrt(E[w^2] - E[w]^2) over float32 sums gave 6.3e-5 at d = 0.123
    out = finalize_metrics(one_row([d], cfg(is_mode="token_truncate", is_threshold=10.0)))
    assert out["is/weight_std"] == 0.0
    assert out["is/weight_mean"] == pytest.approx(math.exp(d), rel=1e-6) and out["is/ess"] == 1.0


def test_weight_std_of_equal_weights_is_exactly_zero():
    config = cfg(is_mode="token_truncate", is_threshold=10.0)
    assert finalize_metrics(one_row([0.123, 0.123], config))["is/weight_std"] == 0.0
    # the same two weights in two calls (micro-batches): the calls' means agree, the spread is 0
    merged = merge_metrics(one_row([0.123], config), one_row([0.123], config))
    assert finalize_metrics(merged)["is/weight_std"] == 0.0
    # a sequence weight is shared by its tokens: 4 tokens, one weight exp(mean d)
    out = finalize_metrics(
        one_row([0.1, 0.3, -0.2, 0.6], cfg(is_mode="sequence_truncate", is_threshold=10.0))
    )
    assert out["is/weight_std"] == 0.0


def two_pass_std(w):
    m = sum(w) / len(w)
    return math.sqrt(sum((x - m) ** 2 for x in w) / len(w))


def test_weight_std_is_the_two_pass_form():
    # a close pair, where the one-pass form loses most digits (its variance is ~2.5e-7)
    d = [0.1, 0.1 + 1e-3]
    out = finalize_metrics(one_row(d, cfg(is_mode="token_truncate", is_threshold=10.0)))
    assert out["is/weight_std"] == pytest.approx(two_pass_std(applied_weights(d)), rel=1e-12)
    # over calls: [2, 0.5, 1] and [4, 0.75, 1] (truncated / bounded weights of the fixture)
    _, _, a = run(cfg(is_mode="token_truncate"))
    _, _, b = run(cfg(is_mode="token_truncate", is_threshold=5.0, is_threshold_low=0.75))
    w = [float(x) for x in torch.tensor([2, 0.5, 1, 4, 0.75, 1]).float()]
    expected = two_pass_std(w)
    assert finalize_metrics(merge_metrics(a, b))["is/weight_std"] == pytest.approx(expected, rel=1e-6)
    # the weights of the fixture are e^(ln 4), e^(-ln 2) in float32, hence rel=1e-6 against exact ones
