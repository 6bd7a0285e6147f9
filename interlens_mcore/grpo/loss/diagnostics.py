"""Off-policy diagnostics: how far the train policy is from the rollout policy, as metric sums.

Measured on the `compared` tokens (loss tokens of samples with complete rollout logprobs and
finite values), before any rejection, so a rule that removes drifted tokens does not hide the
drift it removed. Per-sample figures need each sample entirely in the call. Everything is a sum
(or a '/max'); `finalize` turns the reduced sums into the logged figures.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from interlens_mcore.grpo.loss.aggregation import unit_means, unit_sums

# the keys `off_policy_sums` returns (declared so a rank that trained on nothing knows them)
SUM_KEYS = (
    "is/samples_compared",
    "is/rollout_ppl_sum",
    "is/training_ppl_sum",
    "is/log_ppl_diff_sum",
    "is/chi2_token_sum",
    "is/chi2_seq_sum",
    "is/kl_k1_sum",
    "is/kl_k3_sum",
    "is/abs_logprob_diff_sum",
    "is/abs_logprob_diff/max",
)
# the keys `weight_spread_sums` returns
SPREAD_KEYS = ("is/weight_dev_sq_sum", "is/weight_mean_sq_sum")


def weight_spread_sums(weights: torch.Tensor, corrected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums behind `is/weight_std` that add up over calls and ranks; float64 [B, T] in, scalars out.

    With this call's n corrected weights, their sum S and mean m = S / n: M2 = sum (w - m)^2
    (two passes over the call's weights, so no cancellation) and Q = S^2 / n (0 when n = 0).
    Over calls i with totals n, S, the squared deviations from the overall mean sum to
    sum M2_i + (sum Q_i - S^2 / n) (Chan et al.'s pairwise update): the bracket is the spread of
    the calls' means, exactly 0 for weights that all lie in one call, since `finalize` forms
    S^2 / n from the same float64 S.
    """
    w = torch.where(corrected, weights.double(), 0.0)
    n = corrected.sum().double()
    total = w.sum()
    mean = total / n.clamp(min=1)
    dev = torch.where(corrected, w - mean, 0.0)
    return {
        "is/weight_dev_sq_sum": (dev * dev).sum(),
        "is/weight_mean_sq_sum": torch.where(n > 0, total * total / n.clamp(min=1), 0.0),
    }


def off_policy_sums(
    train: torch.Tensor,
    rollout: torch.Tensor,
    compared: torch.Tensor,
    sample_ids: torch.Tensor,
    num_samples: int,
    clamp: float,
) -> dict[str, torch.Tensor]:
    """Sums behind perplexities, chi-square and the log-ratio figures; [B, T] float inputs.

    train / rollout: logprobs of the targets under the train and rollout policies (0 off
    `compared`). Per sample i over its T_i compared tokens, with d = train - rollout:
    ppl = exp(-mean logprob), log_ppl_diff = mean(rollout) - mean(train) = log ppl_train -
    log ppl_rollout, rho = exp(clamp(sum d, -clamp, clamp)), the product sequence weight of
    `is_weights.unit_log_weight` (the unclamped sum, bounded).
    """
    d = torch.where(compared, train - rollout, 0.0).double()
    w = torch.exp(d.clamp(-clamp, clamp))  # token ratios pi_train / pi_rollout
    ids, n = sample_ids, num_samples
    mean_train, counts = unit_means(train.double(), compared, ids, n)
    mean_rollout, _ = unit_means(rollout.double(), compared, ids, n)
    seen = counts > 0  # [N] samples with at least one compared token
    rho = torch.exp(unit_sums(d, compared, ids, n).clamp(-clamp, clamp))  # [N] sequence weights
    zero = torch.zeros_like(mean_train)

    def over_samples(v: torch.Tensor) -> torch.Tensor:
        return torch.where(seen, v, zero).sum()

    return {
        "is/samples_compared": seen.double().sum(),
        "is/rollout_ppl_sum": over_samples(torch.exp(-mean_rollout)),
        "is/training_ppl_sum": over_samples(torch.exp(-mean_train)),
        "is/log_ppl_diff_sum": over_samples(mean_rollout - mean_train),
        "is/chi2_token_sum": torch.where(compared, w * w, 0.0).sum(),
        "is/chi2_seq_sum": over_samples(rho * rho),
        "is/kl_k1_sum": (-d).sum(),  # KL(rollout || train) sampled from the rollout policy
        "is/kl_k3_sum": torch.where(compared, w - 1 - d.clamp(-clamp, clamp), 0.0).sum(),
        "is/abs_logprob_diff_sum": d.abs().sum(),
        "is/abs_logprob_diff/max": d.abs().max(),
    }


def finalize(s: dict[str, float], frac: Callable[[str, str], float]) -> dict[str, float]:
    """Logged figures from reduced sums; `frac(num, den)` is num / den, 0 over nothing.

    Chi-square of the weights w under the rollout policy: E[w^2] - 1 (0 when on-policy), per
    token and per sequence (rho). is/ess: effective sample size of the applied IS weights as a
    fraction of the corrected tokens, (sum w)^2 / (n sum w^2) in (0, 1]; is/weight_std their
    standard deviation over the corrected tokens (population form, / n) from
    `weight_spread_sums`: exactly 0 for one token or equal weights.
    """
    compared = s["is/tokens_compared"] > 0
    mean_w = frac("is/weight_sum", "is/tokens_corrected")
    mean_w2 = frac("is/weight_sq_sum", "is/tokens_corrected")
    n, total = s["is/tokens_corrected"], s["is/weight_sum"]
    between = s["is/weight_mean_sq_sum"] - total * total / n if n > 0 else 0.0
    spread = max(s["is/weight_dev_sq_sum"] + between, 0.0) / n if n > 0 else 0.0
    return {
        "is/rollout_ppl": frac("is/rollout_ppl_sum", "is/samples_compared"),
        "is/training_ppl": frac("is/training_ppl_sum", "is/samples_compared"),
        "is/log_ppl_diff": frac("is/log_ppl_diff_sum", "is/samples_compared"),
        "is/chi2_token": frac("is/chi2_token_sum", "is/tokens_compared") - 1.0 if compared else 0.0,
        "is/chi2_seq": frac("is/chi2_seq_sum", "is/samples_compared") - 1.0 if compared else 0.0,
        "is/kl_k1": frac("is/kl_k1_sum", "is/tokens_compared"),
        "is/kl_k3": frac("is/kl_k3_sum", "is/tokens_compared"),
        "is/abs_logprob_diff": frac("is/abs_logprob_diff_sum", "is/tokens_compared"),
        "is/abs_logprob_diff/max": s["is/abs_logprob_diff/max"],
        "is/ess": mean_w * mean_w / mean_w2 if mean_w2 > 0 else 0.0,
        "is/weight_std": spread**0.5,
    }
