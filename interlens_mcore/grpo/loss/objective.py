"""GRPO objective with rollout-vs-train importance-sampling (IS) correction. Pure tensor math.

Every [B, T] tensor is on target positions (see `batch.py`). The loss returned by one call is
already divided by the *global* denominators the caller passes (`num_tokens`, `num_sequences`,
counted over every micro-batch and rank whose gradients are summed), so summing the calls'
losses gives the batch loss. Metrics are raw sums (maxima for keys ending in `/max`, minima for
`/min`) to be reduced once across micro-batches and ranks; `finalize_metrics` turns them into
the logged figures.

This file composes the pieces beside it: the options (`config.py`), the surrogates and
their registry (`policy.py`), IS weights and rejection (`is_weights.py`), the KL
estimators (`kl.py`), the aggregation modes (`aggregation.py`), the off-policy diagnostics
(`diagnostics.py`), and the mask of kept tokens that the denominators count (`mask.py`,
whose docstring shows the order a trainer calls things in).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from interlens_mcore.grpo.batch import TrainingBatch
from interlens_mcore.grpo.loss import diagnostics
from interlens_mcore.grpo.loss.aggregation import aggregate, unit_sums
from interlens_mcore.grpo.loss.config import LossConfig
from interlens_mcore.grpo.loss.kl import kl_penalty
from interlens_mcore.grpo.loss.mask import (
    clamped_log_ratio,
    rejected_tokens,
    rollout_weights,
    token_complete,
    token_finite,
)
from interlens_mcore.grpo.loss.policy import POLICY_LOSSES, PolicyInputs


def _check(logprobs, named: Mapping[str, torch.Tensor | None], logprobs_complete, num_tokens, num_sequences):
    if logprobs.dim() != 2 or logprobs.numel() == 0:
        raise ValueError(f"logprobs must be a non-empty [B, T] tensor, got shape {tuple(logprobs.shape)}")
    for name, t in named.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(
                f"{name} must be [B, T] like logprobs {tuple(logprobs.shape)}, got {tuple(t.shape)}"
            )
    if logprobs_complete.dim() != 1 or logprobs_complete.dtype != torch.bool:
        raise ValueError(
            "logprobs_complete must be a [N] bool tensor, got "
            f"{logprobs_complete.dtype} {tuple(logprobs_complete.shape)}"
        )
    if not float(num_tokens) > 0:
        raise ValueError(f"num_tokens must be > 0 (global count of loss tokens), got {num_tokens!r}")
    if not float(num_sequences) > 0:
        raise ValueError(f"num_sequences must be > 0 (global count of samples), got {num_sequences!r}")


def _check_options(
    config: LossConfig, ref_logprobs, segment_ids, token_mask, loss_mask, is_weight_mean
) -> None:
    if config.beta > 0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs are required when LossConfig.beta > 0 (beta={config.beta})")
    if config.correction.startswith("turn") and segment_ids is None:
        raise ValueError(f"segment_ids are required for is_mode {config.is_mode!r}")
    if token_mask is not None:
        if token_mask.dtype != torch.bool:
            raise ValueError(
                f"token_mask must be a bool tensor (from loss_token_mask), got {token_mask.dtype}"
            )
        if bool((token_mask & ~loss_mask.bool()).any()):
            raise ValueError("token_mask must lie within loss_mask (from loss_token_mask of the same batch)")
    if config.is_batch_normalize and (is_weight_mean is None or not float(is_weight_mean) > 0):
        raise ValueError(
            "is_weight_mean (the batch's mean IS weight, from is_weight_sums) must be > 0 when "
            f"LossConfig.is_batch_normalize is True, got {is_weight_mean!r}"
        )


def grpo_loss(
    logprobs: torch.Tensor,
    *,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    logprobs_complete: torch.Tensor,
    sample_ids: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    config: LossConfig,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: int | float | torch.Tensor,
    num_sequences: int | float | torch.Tensor,
    token_mask: torch.Tensor | None = None,
    is_weight_mean: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of one micro-batch and its metric sums.

    logprobs [B, T]: train-policy logprobs of the targets (differentiable). The other [B, T]
    tensors come from `TrainingBatch`; logprobs_complete [N] is indexed by `sample_ids`.
    old_logprobs default to logprobs.detach() (one update per rollout). IS correction applies
    to the tokens of samples whose `logprobs_complete` is True, and only to them: the decision
    is per sample and never depends on other samples of the call. Any loss token with a
    non-finite logprob (train, old, reference, or rollout of a complete sample) is dropped
    from the loss through `torch.where` (NaN * 0 is NaN) and counted in `nonfinite_masked`.
    token_mask [B, T] (from `loss_token_mask`, whose tokens the denominators counted) fixes
    which tokens the rejection rules removed; without it they are decided here, and the
    caller's denominators still count the removed tokens. is_weight_mean: the batch's mean IS
    weight (`is_weight_sums`), required by `is_batch_normalize`.
    Sequence and turn modes, GSPO, 'seq-mean-token-mean' and the per-sample diagnostics need
    each sample entirely in this call.
    """
    named = {
        "loss_mask": loss_mask,
        "advantages": advantages,
        "rollout_logprobs": rollout_logprobs,
        "sample_ids": sample_ids,
        "segment_ids": segment_ids,
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
        "token_mask": token_mask,
    }
    _check(logprobs, named, logprobs_complete, num_tokens, num_sequences)
    _check_options(config, ref_logprobs, segment_ids, token_mask, loss_mask, is_weight_mean)

    c = config.log_ratio_clamp
    n = logprobs_complete.numel()
    train_raw = old_logprobs if old_logprobs is not None else logprobs.detach()
    t = _kept_tokens(
        logprobs, train_raw, loss_mask, advantages, rollout_logprobs, logprobs_complete, sample_ids,
        config, old_logprobs, ref_logprobs, token_mask,
    )  # fmt: skip

    def clean(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return torch.where(where, x.float(), 0.0)

    lp = clean(logprobs, t.valid)  # [B, T]; gradient flows only through valid tokens
    train = clean(train_raw, t.valid).detach()
    rollout = clean(rollout_logprobs, t.compared)

    weights = torch.ones_like(lp)
    truncated = masked = torch.zeros_like(t.mask)
    if config.is_mode != "none":
        diff = torch.where(t.compared, t.diff_c, 0.0)
        weights, truncated, masked = rollout_weights(diff, t.compared, sample_ids, segment_ids, config)
        if config.is_batch_normalize:
            assert is_weight_mean is not None, "_check_options requires it with is_batch_normalize"
            weights = torch.where(t.compared, weights / float(is_weight_mean), weights)
    old = torch.where(t.compared, rollout, train) if config.bypass else train

    adv = torch.where(t.valid, advantages.float(), 0.0)
    inputs = PolicyInputs(
        logprobs=lp, old_logprobs=old, advantages=adv, valid=t.valid, sample_ids=sample_ids, num_samples=n
    )
    terms = POLICY_LOSSES[config.policy_loss](inputs, config)
    policy = torch.where(t.valid, weights * terms.per_token, 0.0)

    kl = torch.zeros_like(lp)
    if ref_logprobs is not None:
        est = kl_penalty(lp, clean(ref_logprobs, t.valid), config.kl_estimator, c, config.kl_clamp)
        kl = torch.where(t.valid, est, kl)

    def agg(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate(
            per_token,
            t.valid,
            sample_ids,
            n,
            mode=config.aggregation,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            scale_factor=config.loss_scale_factor,
        )

    policy_loss = agg(policy)
    kl_weights = weights if config.kl_is_weighted else 1.0
    kl_loss = agg(config.beta * kl_weights * kl) if config.beta > 0 else policy_loss.new_zeros(())

    correcting = config.bypass or config.is_mode != "none"
    corrected = t.compared if correcting else torch.zeros_like(t.compared)
    is_weight = torch.where(t.compared, torch.exp(t.diff_c), 1.0) if config.bypass else weights
    present = unit_sums(t.mask.float(), t.mask, sample_ids, n) > 0  # [N] samples with loss tokens here
    metrics = _metric_sums(
        {
            "loss/policy": policy_loss,
            "loss/kl": kl_loss,
            "tokens": t.mask,
            "tokens_kept": t.valid,
            "samples": present,
            "samples_complete": present & logprobs_complete,
            "nonfinite_masked": t.mask & ~t.finite,
            "clip/tokens_clipped": terms.clipped & t.valid,
            "clip/tokens_dual_clipped": terms.dual_clipped & t.valid,
            "kl/ref_sum": kl,
            "ppo_kl_sum": torch.where(t.valid, old - lp.detach(), 0.0),  # k1 of KL(old || train)
            "is/samples_corrected": present & logprobs_complete & correcting,
            "is/tokens_corrected": corrected,
            "is/tokens_compared": t.measured,
            "is/tokens_truncated": truncated,
            "is/tokens_masked": masked,
            "is/tokens_rejected": t.rejected,
            "is/weight_sum": torch.where(corrected, is_weight, 0.0),
            "is/weight_sq_sum": torch.where(corrected, is_weight * is_weight, 0.0),
        }
    )
    measured_train, measured_rollout = clean(train_raw, t.measured), clean(rollout_logprobs, t.measured)
    metrics.update(
        diagnostics.off_policy_sums(measured_train, measured_rollout, t.measured, sample_ids, n, c)
    )
    metrics["ratio/max"] = torch.where(t.valid, terms.ratio, 0.0).max()
    metrics["is/weight/max"] = torch.where(corrected, is_weight, 0.0).max()
    metrics["is/weight/min"] = torch.where(corrected, is_weight, math.inf).min()
    return policy_loss + kl_loss, {k: v.detach().float() for k, v in metrics.items()}


@dataclass(frozen=True)
class _Tokens:
    """[B, T] masks of one call, each a subset of the one before where it says so."""

    mask: torch.Tensor  # loss tokens
    finite: torch.Tensor  # every logprob the loss reads is finite
    measured: torch.Tensor  # mask & finite & complete: train vs rollout is known (diagnostics)
    diff_c: torch.Tensor  # clamped log pi_train - log pi_rollout on `measured`, else 0
    rejected: torch.Tensor  # finite loss tokens a rejection rule removed
    valid: torch.Tensor  # mask & finite & ~rejected: the tokens in the loss
    compared: torch.Tensor  # valid & complete: the tokens IS correction may touch


def _kept_tokens(
    logprobs, train_raw, loss_mask, advantages, rollout_logprobs, logprobs_complete, sample_ids,
    config, old_logprobs, ref_logprobs, token_mask,
) -> _Tokens:  # fmt: skip
    mask = loss_mask.bool()
    complete = token_complete(logprobs_complete, sample_ids)  # [B, T]
    finite = token_finite(logprobs, rollout_logprobs, complete, old_logprobs, ref_logprobs)
    measured = mask & finite & complete
    diff_c = clamped_log_ratio(train_raw, rollout_logprobs, measured, config.log_ratio_clamp)
    if token_mask is None:
        rejected = rejected_tokens(diff_c, measured, sample_ids, advantages, config)
    else:  # decided before the backward pass; a token non-finite now is counted as such instead
        rejected = mask & finite & ~token_mask
    valid = mask & finite & ~rejected
    return _Tokens(mask, finite, measured, diff_c, rejected, valid, valid & complete)


def _metric_sums(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().sum() for k, v in values.items()}


def batch_loss(
    logprobs: torch.Tensor,
    batch: TrainingBatch,
    config: LossConfig,
    *,
    token_mask: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`grpo_loss` on a whole `TrainingBatch`.

    token_mask: `loss_token_mask` of this batch (then the denominators from `denominators`
    exclude every dropped token). kwargs: old/ref logprobs, the global denominators,
    is_weight_mean.
    """
    return grpo_loss(
        logprobs,
        loss_mask=batch.loss_mask,
        advantages=batch.advantages,
        rollout_logprobs=batch.rollout_logprobs,
        logprobs_complete=batch.logprobs_complete,
        sample_ids=batch.sample_ids,
        segment_ids=batch.segment_ids,
        config=config,
        token_mask=token_mask,
        **kwargs,
    )


def reduction(key: str) -> str:
    """How a metric reduces over micro-batches and ranks: by its key's suffix ('/max', '/min'), else sum."""
    return "max" if key.endswith("/max") else "min" if key.endswith("/min") else "sum"


def merge_metrics(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Combine two calls' metrics: sum, max for keys ending in '/max', min for '/min'."""
    if a.keys() != b.keys():
        raise ValueError(f"metrics must have the same keys, got {sorted(a.keys() ^ b.keys())} in only one")
    ops: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "sum": torch.add,
        "max": torch.maximum,
        "min": torch.minimum,
    }
    return {k: ops[reduction(k)](a[k], b[k]) for k in a}


def empty_metrics() -> dict[str, torch.Tensor]:
    """Every metric key of `grpo_loss` at the neutral value of its reduction (0, or +inf for '/min').

    For a rank that trained on nothing but joins the reductions; the key set is the same for
    every `LossConfig`.
    """
    ids = torch.tensor([[0, 0]])
    _, m = grpo_loss(
        torch.zeros(1, 2),
        loss_mask=torch.tensor([[False, True]]),
        advantages=torch.zeros(1, 2),
        rollout_logprobs=torch.zeros(1, 2),
        logprobs_complete=torch.tensor([False]),
        sample_ids=ids,
        segment_ids=ids,
        config=LossConfig(beta=0.0, is_mode="none"),
        num_tokens=1,
        num_sequences=1,
    )
    return {k: torch.tensor(math.inf if reduction(k) == "min" else 0.0) for k in m}


def finalize_metrics(sums: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Means and fractions from reduced metric sums (a fraction over nothing is reported as 0)."""
    s = {k: float(v) for k, v in sums.items()}

    def frac(num: str, den: str) -> float:
        return s[num] / s[den] if s[den] > 0 else 0.0

    weight_min = s["is/weight/min"]
    return {
        "loss/policy": s["loss/policy"],
        "loss/kl": s["loss/kl"],
        "tokens": s["tokens"],
        "tokens_kept": s["tokens_kept"],
        "samples": s["samples"],
        "nonfinite_masked": s["nonfinite_masked"],
        "clip/fraction": frac("clip/tokens_clipped", "tokens_kept"),
        "clip/dual_fraction": frac("clip/tokens_dual_clipped", "tokens_kept"),
        "ratio/max": s["ratio/max"],
        "ppo_kl": frac("ppo_kl_sum", "tokens_kept"),
        "kl/ref": frac("kl/ref_sum", "tokens_kept"),
        "is/complete_fraction": frac("samples_complete", "samples"),
        "is/sample_fraction": frac("is/samples_corrected", "samples"),
        "is/token_fraction": frac("is/tokens_corrected", "tokens"),
        "is/weight_mean": frac("is/weight_sum", "is/tokens_corrected"),
        "is/weight/max": s["is/weight/max"],
        # +inf when no rank corrected a token (the neutral value of the min): reported as 0
        "is/weight/min": weight_min if math.isfinite(weight_min) and s["is/tokens_corrected"] > 0 else 0.0,
        "is/truncated_fraction": frac("is/tokens_truncated", "is/tokens_corrected"),
        "is/masked_fraction": frac("is/tokens_masked", "is/tokens_corrected"),
        "is/rejected_fraction": frac("is/tokens_rejected", "tokens"),
        **diagnostics.finalize(s, frac),
    }
