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
