"""GRPO objective with rollout-vs-train importance-sampling (IS) correction. Pure tensor math.

Every [B, T] tensor is on target positions (see `batch.py`). The loss returned by one call is
already divided by the *global* denominators the caller passes (`num_tokens`, `num_sequences`,
counted over every micro-batch and rank whose gradients are summed), so summing the calls'
losses gives the batch loss. Metrics are raw sums (maxima for keys ending in `/max`, minima for
`/min`) to be reduced once across micro-batches and ranks (`metrics.py`: the keys, the
reduction rule, `finalize_metrics` for the logged figures).

`grpo_loss` runs named steps: check the inputs (`LossInputs`), decide the kept tokens, the
rollout IS correction, the policy surrogate, the KL term, aggregate, and collect the metrics.
It composes the pieces beside it: the options (`config.py`), the surrogates and their registry
(`policy.py`), IS weights and rejection (`is_weights.py`), the KL estimators (`kl.py`), the
aggregation modes (`aggregation.py`), the off-policy diagnostics (`diagnostics.py`), and the
mask of kept tokens that the denominators count (`mask.py`, whose docstring shows the order a
trainer calls things in).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from interlens_mcore.grpo.batch import TrainingBatch
from interlens_mcore.grpo.loss import diagnostics
from interlens_mcore.grpo.loss.aggregation import aggregate, unit_sums
from interlens_mcore.grpo.loss.config import LossConfig
from interlens_mcore.grpo.loss.kl import kl_penalty
from interlens_mcore.grpo.loss.mask import (
    log_ratio,
    rejected_tokens,
    rollout_weights,
    token_complete,
    token_finite,
)
from interlens_mcore.grpo.loss.policy import POLICY_LOSSES, PolicyInputs, PolicyTerms


@dataclass(frozen=True)
class LossInputs:
    """The tensors and global counts of one `grpo_loss` call (its keyword arguments, checked)."""

    logprobs: torch.Tensor  # [B, T] train-policy logprobs of the targets, differentiable
    loss_mask: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B, T]
    rollout_logprobs: torch.Tensor  # [B, T]; NaN placeholders allowed for incomplete samples
    logprobs_complete: torch.Tensor  # [N] bool, indexed by sample_ids
    sample_ids: torch.Tensor  # [B, T] int64, -1 on padding
    segment_ids: torch.Tensor | None  # [B, T], needed by the turn IS modes
    old_logprobs: torch.Tensor | None  # [B, T]; None: logprobs.detach()
    ref_logprobs: torch.Tensor | None  # [B, T]; needed when beta > 0
    token_mask: torch.Tensor | None  # [B, T] bool from loss_token_mask
    num_tokens: int | float | torch.Tensor  # global denominators (every micro-batch and rank)
    num_sequences: int | float | torch.Tensor
    is_weight_mean: float | torch.Tensor | None  # the batch's mean IS weight (is_batch_normalize)
    entropy: torch.Tensor | None = None  # [B, T] policy entropy with gradient (entropy_coeff > 0)
    entropy_mask: torch.Tensor | None = None  # [B, T] bool: the tokens given the policy loss

    @property
    def num_samples(self) -> int:
        return self.logprobs_complete.numel()

    def shaped(self) -> dict[str, torch.Tensor | None]:
        """The [B, T] inputs besides logprobs, by name, in the order their shapes are checked."""
        return {
            "loss_mask": self.loss_mask,
            "advantages": self.advantages,
            "rollout_logprobs": self.rollout_logprobs,
            "sample_ids": self.sample_ids,
            "segment_ids": self.segment_ids,
            "old_logprobs": self.old_logprobs,
            "ref_logprobs": self.ref_logprobs,
            "token_mask": self.token_mask,
            "entropy": self.entropy,
            "entropy_mask": self.entropy_mask,
        }

    @property
    def train_raw(self) -> torch.Tensor:
        """The old policy's logprobs as given (the PPO ratio's denominator), not yet cleaned."""
        return self.old_logprobs if self.old_logprobs is not None else self.logprobs.detach()


def _check(x: LossInputs) -> None:
    lp = x.logprobs
    if lp.dim() != 2 or lp.numel() == 0:
        raise ValueError(f"logprobs must be a non-empty [B, T] tensor, got shape {tuple(lp.shape)}")
    for name, t in x.shaped().items():
        if t is not None and t.shape != lp.shape:
            raise ValueError(f"{name} must be [B, T] like logprobs {tuple(lp.shape)}, got {tuple(t.shape)}")
    complete = x.logprobs_complete
    if complete.dim() != 1 or complete.dtype != torch.bool:
        raise ValueError(
            f"logprobs_complete must be a [N] bool tensor, got {complete.dtype} {tuple(complete.shape)}"
        )
    if not float(x.num_tokens) > 0:
        raise ValueError(f"num_tokens must be > 0 (global count of loss tokens), got {x.num_tokens!r}")
    if not float(x.num_sequences) > 0:
        raise ValueError(f"num_sequences must be > 0 (global count of samples), got {x.num_sequences!r}")


def _check_options(config: LossConfig, x: LossInputs) -> None:
    if config.beta > 0 and x.ref_logprobs is None:
        raise ValueError(f"ref_logprobs are required when LossConfig.beta > 0 (beta={config.beta})")
    if config.correction.startswith("turn") and x.segment_ids is None:
        raise ValueError(f"segment_ids are required for is_mode {config.is_mode!r}")
    if x.token_mask is not None:
        if x.token_mask.dtype != torch.bool:
            raise ValueError(
                f"token_mask must be a bool tensor (from loss_token_mask), got {x.token_mask.dtype}"
            )
        if bool((x.token_mask & ~x.loss_mask.bool()).any()):
            raise ValueError("token_mask must lie within loss_mask (from loss_token_mask of the same batch)")
    if config.entropy_coeff > 0 and x.entropy is None:
        raise ValueError(
            "entropy (the policy's token entropy, with gradient) is required when LossConfig.entropy_coeff "
            f"> 0 (entropy_coeff={config.entropy_coeff})"
        )
    if x.entropy_mask is not None and x.entropy_mask.dtype != torch.bool:
        raise ValueError(f"entropy_mask must be a bool tensor, got {x.entropy_mask.dtype}")
    mean = x.is_weight_mean
    if config.is_batch_normalize and (mean is None or not float(mean) > 0):
        raise ValueError(
            "is_weight_mean (the batch's mean IS weight, from is_weight_sums) must be > 0 when "
            f"LossConfig.is_batch_normalize is True, got {mean!r}"
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
    entropy: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
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
    weight (`is_weight_sums`), required by `is_batch_normalize`. entropy [B, T]: the policy's
    token entropy with gradient, required when `entropy_coeff` > 0: the loss then subtracts
    entropy_coeff times its aggregate over the kept tokens (the policy loss's aggregation and
    denominators). entropy_mask [B, T] bool (`top_entropy_quantile`): the kept tokens outside
    it get no policy loss (KL and entropy terms, and the denominators, still count them).
    Sequence and turn modes, GSPO, 'seq-mean-token-mean' and the per-sample diagnostics need
    each sample entirely in this call.
    """
    x = LossInputs(
        logprobs=logprobs,
        loss_mask=loss_mask,
        advantages=advantages,
        rollout_logprobs=rollout_logprobs,
        logprobs_complete=logprobs_complete,
        sample_ids=sample_ids,
        segment_ids=segment_ids,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        token_mask=token_mask,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        is_weight_mean=is_weight_mean,
        entropy=entropy,
        entropy_mask=entropy_mask,
    )
    _check(x)
    _check_options(config, x)
    t = _kept_tokens(x, config)
    w = _rollout_correction(x, t, config)
    p = _policy_terms(x, t, w, config)
    kl = _kl_per_token(x, t, p.logprobs, config)
    policy_loss = _aggregate(x, t, config, p.per_token)
    kl_weights = w.weights if config.kl_is_weighted else 1.0
    kl_loss = policy_loss.new_zeros(())
    if config.beta > 0:
        kl_loss = _aggregate(x, t, config, config.beta * kl_weights * kl)
    metrics = _metrics(x, t, w, p, kl, config, losses=(policy_loss, kl_loss))
    loss = policy_loss + kl_loss
    if config.entropy_coeff > 0:
        assert x.entropy is not None, "_check_options requires it with entropy_coeff > 0"
        h = torch.where(t.valid & torch.isfinite(x.entropy), x.entropy.float(), 0.0)
        loss = loss - config.entropy_coeff * _aggregate(x, t, config, h)
    return loss, metrics


@dataclass(frozen=True)
class _Tokens:
    """[B, T] masks of one call, each a subset of the one before where it says so."""

    mask: torch.Tensor  # loss tokens
    finite: torch.Tensor  # every logprob the loss reads is finite
    measured: torch.Tensor  # mask & finite & complete: train vs rollout is known (diagnostics)
    diff: torch.Tensor  # float64 log pi_train - log pi_rollout on `measured`, else 0 (unclamped)
    diff_c: torch.Tensor  # the same, float32 clamped to +-log_ratio_clamp
    rejected: torch.Tensor  # finite loss tokens a rejection rule removed
    valid: torch.Tensor  # mask & finite & ~rejected: the tokens in the loss
    compared: torch.Tensor  # valid & complete: the tokens IS correction may touch


def _kept_tokens(x: LossInputs, config: LossConfig) -> _Tokens:
    """Which loss tokens are finite, measured, rejected and kept."""
    mask = x.loss_mask.bool()
    complete = token_complete(x.logprobs_complete, x.sample_ids)  # [B, T]
    finite = token_finite(x.logprobs, x.rollout_logprobs, complete, x.old_logprobs, x.ref_logprobs)
    measured = mask & finite & complete
    diff = log_ratio(x.train_raw, x.rollout_logprobs, measured)
    diff_c = diff.clamp(-config.log_ratio_clamp, config.log_ratio_clamp).float()
    if x.token_mask is None:
        rejected = rejected_tokens(diff_c, measured, x.sample_ids, x.advantages, config)
    else:  # decided before the backward pass; a token non-finite now is counted as such instead
        rejected = mask & finite & ~x.token_mask
    valid = mask & finite & ~rejected
    return _Tokens(mask, finite, measured, diff, diff_c, rejected, valid, valid & complete)


def _clean(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """float32 `x` where `where`, else 0 (so a NaN off `where` never reaches a product)."""
    return torch.where(where, x.float(), 0.0)


@dataclass(frozen=True)
class _Correction:
    """The rollout IS weights of the kept tokens and what the IS mode did to them."""

    weights: torch.Tensor  # [B, T] float32, 1 where nothing corrects
    truncated: torch.Tensor  # [B, T] bool
    masked: torch.Tensor  # [B, T] bool
    old: torch.Tensor  # [B, T] the PPO ratio's old policy (the rollout one on `compared` in bypass)


def _rollout_correction(x: LossInputs, t: _Tokens, config: LossConfig) -> _Correction:
    train = _clean(x.train_raw, t.valid).detach()
    weights = torch.ones_like(train)
    truncated = masked = torch.zeros_like(t.mask)
    if config.is_mode != "none":
        diff = torch.where(t.compared, t.diff, 0.0)
        weights, truncated, masked = rollout_weights(diff, t.compared, x.sample_ids, x.segment_ids, config)
        if config.is_batch_normalize:
            assert x.is_weight_mean is not None, "_check_options requires it with is_batch_normalize"
            weights = torch.where(t.compared, weights / float(x.is_weight_mean), weights)
    rollout = _clean(x.rollout_logprobs, t.compared)
    old = torch.where(t.compared, rollout, train) if config.bypass else train
    return _Correction(weights, truncated, masked, old)


@dataclass(frozen=True)
class _Policy:
    """The policy surrogate of the kept tokens."""

    logprobs: torch.Tensor  # [B, T] float32 train logprobs, 0 off valid (gradient flows on valid)
    terms: PolicyTerms
    per_token: torch.Tensor  # [B, T] the surrogate times the IS weights, 0 off valid


def _policy_terms(x: LossInputs, t: _Tokens, w: _Correction, config: LossConfig) -> _Policy:
    lp = _clean(x.logprobs, t.valid)
    adv = torch.where(t.valid, x.advantages.float(), 0.0)
    inputs = PolicyInputs(
        logprobs=lp,
        old_logprobs=w.old,
        advantages=adv,
        valid=t.valid,
        sample_ids=x.sample_ids,
        num_samples=x.num_samples,
    )
    terms = POLICY_LOSSES[config.policy_loss](inputs, config)
    gets_loss = t.valid if x.entropy_mask is None else t.valid & x.entropy_mask
    return _Policy(lp, terms, torch.where(gets_loss, w.weights * terms.per_token, 0.0))


def _kl_per_token(x: LossInputs, t: _Tokens, lp: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """[B, T] KL(train || reference) estimate per kept token; 0 without reference logprobs."""
    kl = torch.zeros_like(lp)
    if x.ref_logprobs is None:
        return kl
    ref = _clean(x.ref_logprobs, t.valid)
    est = kl_penalty(lp, ref, config.kl_estimator, config.log_ratio_clamp, config.kl_clamp)
    return torch.where(t.valid, est, kl)


def _aggregate(x: LossInputs, t: _Tokens, config: LossConfig, per_token: torch.Tensor) -> torch.Tensor:
    return aggregate(
        per_token,
        t.valid,
        x.sample_ids,
        x.num_samples,
        mode=config.aggregation,
        num_tokens=x.num_tokens,
        num_sequences=x.num_sequences,
        scale_factor=config.loss_scale_factor,
    )


def _metrics(
    x: LossInputs,
    t: _Tokens,
    w: _Correction,
    p: _Policy,
    kl: torch.Tensor,
    config: LossConfig,
    *,
    losses: tuple[torch.Tensor, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The call's metrics (the keys of `metrics.METRIC_KEYS`), detached float64.

    float64 so that the sums behind `is/weight_std` reduce without rounding: one call's share
    of the spread cancels exactly (`diagnostics.weight_spread_sums`).
    """
    n, ids, terms = x.num_samples, x.sample_ids, p.terms
    correcting = config.bypass or config.is_mode != "none"
    corrected = t.compared if correcting else torch.zeros_like(t.compared)
    is_weight = torch.where(t.compared, torch.exp(t.diff_c), 1.0) if config.bypass else w.weights
    present = unit_sums(t.mask.float(), t.mask, ids, n) > 0  # [N] samples with loss tokens here
    out = _metric_sums(
        {
            "loss/policy": losses[0],
            "loss/kl": losses[1],
            "tokens": t.mask,
            "tokens_kept": t.valid,
            "samples": present,
            "samples_complete": present & x.logprobs_complete,
            "nonfinite_masked": t.mask & ~t.finite,
            "clip/tokens_clipped": terms.clipped & t.valid,
            "clip/tokens_dual_clipped": terms.dual_clipped & t.valid,
            "kl/ref_sum": kl,
            "ppo_kl_sum": torch.where(t.valid, w.old - p.logprobs.detach(), 0.0),  # k1 of KL(old || train)
            "is/samples_corrected": present & x.logprobs_complete & correcting,
            "is/tokens_corrected": corrected,
            "is/tokens_compared": t.measured,
            "is/tokens_truncated": w.truncated,
            "is/tokens_masked": w.masked,
            "is/tokens_rejected": t.rejected,
            "is/weight_sum": torch.where(corrected, is_weight, 0.0),
            "is/weight_sq_sum": torch.where(corrected, is_weight.double() ** 2, 0.0),  # exact square
        }
    )
    train, rollout = _clean(x.train_raw, t.measured), _clean(x.rollout_logprobs, t.measured)
    out.update(diagnostics.off_policy_sums(train, rollout, t.measured, ids, n, config.log_ratio_clamp))
    out.update(diagnostics.weight_spread_sums(is_weight, corrected))
    out["ratio/max"] = torch.where(t.valid, terms.ratio, 0.0).max()
    out["is/weight/max"] = torch.where(corrected, is_weight, 0.0).max()
    out["is/weight/min"] = torch.where(corrected, is_weight, math.inf).min()
    return {k: v.detach().double() for k, v in out.items()}


def _metric_sums(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().sum() for k, v in values.items()}


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
