"""Which loss tokens stay in the loss, decided once before the backward pass. Pure tensor math.

A loss token leaves when a logprob it needs is not finite, or when a rejection rule
(`LossConfig.rejection`, `off_policy_sequence_mask_delta`) removes it. Both global
denominators must then leave it out too, and they are fixed before the first backward pass,
so the trainer runs these functions in a no-grad pass over its micro-batches:

    old = [policy_logprobs(b) for b in batches]  # no grad; the old policy of every update
    masks = [loss_token_mask(b, lp, config, ref_logprobs=ref) for b, lp, ref in zip(batches, old, refs)]
    counts = sum(denominators(m, b) for m, b in zip(masks, batches))  # then all-reduce (sum) over DP
    loss, metrics = batch_loss(lp, b, config, token_mask=m, num_tokens=counts[0], num_sequences=counts[1])

`grpo_loss` uses the same helpers, so without a `token_mask` it removes the same tokens from the
loss, but cannot remove them from denominators it is given.
"""

from __future__ import annotations

import torch

from interlens_mcore.grpo.batch import TrainingBatch
from interlens_mcore.grpo.loss.aggregation import unit_sums
from interlens_mcore.grpo.loss.config import LossConfig
from interlens_mcore.grpo.loss.is_weights import importance_weights, off_policy_sequence_mask, rejection_mask


def token_complete(logprobs_complete: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the position's sample has usable rollout logprobs."""
    return torch.where(sample_ids >= 0, logprobs_complete[sample_ids.clamp(min=0)], False)


def token_finite(logprobs, rollout_logprobs, complete, *extra) -> torch.Tensor:
    """[B, T] bool: every logprob the loss reads at the position is finite.

    Rollout logprobs of an incomplete sample are never read (they may be NaN placeholders).
    """
    finite = torch.isfinite(logprobs) & (torch.isfinite(rollout_logprobs) | ~complete)
    for t in extra:
        if t is not None:
            finite &= torch.isfinite(t)
    return finite


def rejected_tokens(diff_c, measured, sample_ids, advantages, config: LossConfig) -> torch.Tensor:
    """[B, T] bool: measured tokens that the rejection rules remove."""
    out = torch.zeros_like(measured)
    if config.rejection != "none":
        assert config.rejection_threshold is not None, "LossConfig requires it for every rule"
        out |= rejection_mask(
            diff_c,
            measured,
            sample_ids,
            rule=config.rejection,
            threshold=config.rejection_threshold,
            threshold_low=config.rejection_threshold_low,
        )
    if config.off_policy_sequence_mask_delta is not None:
        out |= off_policy_sequence_mask(
            diff_c, measured, sample_ids, advantages, config.off_policy_sequence_mask_delta
        )
    return out


def log_ratio(train, rollout, where) -> torch.Tensor:
    """[B, T] float64 log pi_train - log pi_rollout, unclamped, 0 off `where` (no gradient).

    float64: the difference of two finite float32 logprobs, and a unit's sum of them, stay finite.
    """
    return torch.where(where, train.detach().double() - rollout.double(), 0.0)


def clamped_log_ratio(train, rollout, where, clamp) -> torch.Tensor:
    """[B, T] float32 log pi_train - log pi_rollout, clamped to +-clamp, 0 off `where` (no gradient)."""
    return log_ratio(train, rollout, where).clamp(-clamp, clamp).float()


def rollout_weights(diff, corrected, sample_ids, segment_ids, config: LossConfig):
    """`importance_weights` under `config`; `diff` [B, T] the unclamped log-ratio (`log_ratio`)."""
    groups = sample_ids if config.correction.startswith("sequence") else segment_ids
    return importance_weights(
        diff,
        corrected,
        mode=config.correction,
        threshold=config.is_threshold,
        group_ids=groups,
        threshold_low=config.is_threshold_low,
        sequence_weight=config.is_sequence_weight,
        clamp=config.log_ratio_clamp,
    )


def loss_token_mask(
    batch: TrainingBatch,
    logprobs: torch.Tensor,
    config: LossConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, T] bool: the loss tokens that stay in the loss (and in the denominators).

    `logprobs` [B, T]: the old policy's logprobs of the targets (a no-grad forward before the
    update; with one update per rollout these are the logprobs the loss will see). A loss token
    leaves when a logprob it needs is non-finite or a rejection rule removes it. Pass the result
    to `denominators` and, for the same micro-batch, to `batch_loss(..., token_mask=)`.
    """
    if logprobs.shape != batch.loss_mask.shape:
        raise ValueError(
            f"logprobs must be [B, T] like the batch {tuple(batch.loss_mask.shape)}, "
            f"got {tuple(logprobs.shape)}"
        )
    if ref_logprobs is not None and ref_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"ref_logprobs must be [B, T] like logprobs {tuple(logprobs.shape)}, "
            f"got {tuple(ref_logprobs.shape)}"
        )
    mask = batch.loss_mask.bool()
    complete = token_complete(batch.logprobs_complete, batch.sample_ids)
    finite = token_finite(logprobs, batch.rollout_logprobs, complete, ref_logprobs)
    measured = mask & finite & complete
    diff_c = clamped_log_ratio(logprobs, batch.rollout_logprobs, measured, config.log_ratio_clamp)
    return mask & finite & ~rejected_tokens(diff_c, measured, batch.sample_ids, batch.advantages, config)


def denominators(mask: torch.Tensor, batch: TrainingBatch) -> torch.Tensor:
    """float64 [2]: (loss tokens, samples with at least one) under `mask` [B, T]; sum, then all-reduce."""
    if mask.shape != batch.loss_mask.shape or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a [B, T] bool tensor like loss_mask {tuple(batch.loss_mask.shape)}, "
            f"got {mask.dtype} {tuple(mask.shape)}"
        )
    per_sample = unit_sums(mask.double(), mask, batch.sample_ids, batch.num_samples)
    return torch.stack([mask.sum().double(), (per_sample > 0).sum().double()])


def is_weight_sums(
    batch: TrainingBatch, logprobs: torch.Tensor, mask: torch.Tensor, config: LossConfig
) -> torch.Tensor:
    """float64 [2]: (sum of IS weights, corrected tokens) for `is_batch_normalize`.

    Same inputs as `loss_token_mask` plus its `mask`. Sum over micro-batches, all-reduce, and
    pass sum / count as `is_weight_mean` to `batch_loss`.
    """
    if config.is_mode == "none":
        raise ValueError("LossConfig.is_mode must not be 'none' for is_weight_sums, got 'none'")
    corrected = mask & token_complete(batch.logprobs_complete, batch.sample_ids)
    diff = log_ratio(logprobs, batch.rollout_logprobs, corrected)
    weights, _, _ = rollout_weights(diff, corrected, batch.sample_ids, batch.segment_ids, config)
    return torch.stack([torch.where(corrected, weights, 0.0).sum().double(), corrected.sum().double()])
