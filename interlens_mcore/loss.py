"""GRPO objective with rollout-vs-train importance-sampling (IS) correction. Pure tensor math.

Every [B, T] tensor is on target positions (see `batch.py`). The loss returned by one call is
already divided by the *global* denominators the caller passes (`num_tokens`, `num_sequences`,
counted over every micro-batch and rank whose gradients are summed), so summing the calls'
losses gives the batch loss. Metrics are raw sums (maxima for keys ending in `/max`, minima for
`/min`) to be reduced once across micro-batches and ranks; `finalize_metrics` turns them into
the logged figures.

The pieces live beside this file: surrogates in `policy_loss.py`, IS weights and rejection in
`is_weights.py`, the KL estimators in `kl.py`, the aggregation modes in `aggregation.py`, the
off-policy diagnostics in `diagnostics.py`.

Denominators that exclude dropped tokens. A loss token is dropped for a non-finite logprob or
removed by a rejection rule (`rejection`, `off_policy_sequence_mask_delta`). For it to leave
both global denominators, the caller decides the mask before the backward pass:

    masks = [loss_token_mask(b, old_lp, config, ref_logprobs=ref) for b, old_lp, ref in ...]
    counts = sum(denominators(m, b) for m, b in zip(masks, batches))  # all-reduce over DP
    loss, metrics = batch_loss(lp, b, config, token_mask=m, num_tokens=..., num_sequences=...)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from interlens_mcore import diagnostics
from interlens_mcore.aggregation import AGGREGATIONS, Aggregation, aggregate, unit_sums
from interlens_mcore.batch import TrainingBatch
from interlens_mcore.is_weights import (
    IS_MODES,
    REJECTIONS,
    SEQUENCE_WEIGHTS,
    IsMode,
    Rejection,
    SequenceWeight,
    importance_weights,
    off_policy_sequence_mask,
    rejection_mask,
)
from interlens_mcore.kl import KL_ESTIMATORS, KLEstimator, kl_penalty
from interlens_mcore.policy_loss import POLICY_LOSSES, PolicyInputs

__all__ = [
    "AGGREGATIONS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "LossConfig",
    "batch_loss",
    "denominators",
    "empty_metrics",
    "finalize_metrics",
    "grpo_loss",
    "importance_weights",
    "is_weight_sums",
    "kl_penalty",
    "loss_token_mask",
    "merge_metrics",
]


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Knobs of `grpo_loss`; the command line is generated from these fields."""

    epsilon: float = field(default=0.2, metadata={"help": "ratio clipped to [1 - epsilon, 1 + epsilon_high]"})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "upper clip range (clip-higher, DAPO); None: epsilon"}
    )
    dual_clip: float | None = field(
        default=None, metadata={"help": "for A < 0, cap the loss at -A * dual_clip (> 1); None: off"}
    )
    policy_loss: str = field(
        default="vanilla",
        metadata={"help": "surrogate: vanilla (PPO clip), gspo (sequence ratio), cispo, or a registered one"},
    )
    beta: float = field(
        default=0.005, metadata={"help": "coefficient of KL(train || reference); 0: no reference model"}
    )
    kl_estimator: KLEstimator = field(
        default="k3", metadata={"help": "KL estimator; k1+ / k3+: k1 / k3 value with the k2 gradient"}
    )
    kl_clamp: float | None = field(
        default=None, metadata={"help": "clamp each token's KL estimate to [-kl_clamp, kl_clamp]; None: off"}
    )
    kl_is_weighted: bool = field(
        default=False, metadata={"help": "multiply the KL term by the rollout IS weights too"}
    )
    aggregation: Aggregation = field(
        default="token-mean", metadata={"help": "how per-token losses become the loss"}
    )
    loss_scale_factor: float | None = field(
        default=None,
        metadata={"help": "constant length L of seq-mean-token-sum-norm: sum / (sequences * L) (Dr. GRPO)"},
    )
    is_mode: IsMode | None = field(
        default="token_truncate", metadata={"help": "rollout IS correction; none: diagnostics only"}
    )
    is_threshold: float = field(
        default=2.0, metadata={"help": "IS weights truncated at it, or masked above it"}
    )
    is_threshold_low: float | None = field(
        default=None, metadata={"help": "lower bound of the IS weights (two-sided); None: none"}
    )
    is_sequence_weight: SequenceWeight = field(
        default="geometric",
        metadata={"help": "sequence / turn IS weight: geometric mean or product of the token ratios"},
    )
    is_batch_normalize: bool = field(
        default=False, metadata={"help": "rescale the IS weights to mean 1 over the batch"}
    )
    rejection: Rejection = field(
        default="none",
        metadata={
            "help": "reject off-policy tokens (out of loss and denominators): token / sequence ratio, KL"
        },
    )
    rejection_threshold: float | None = field(
        default=None,
        metadata={"help": "upper bound of the rejection rule (a ratio, or nats for sequence_k1 / _k3)"},
    )
    rejection_threshold_low: float | None = field(
        default=None,
        metadata={"help": "lower ratio bound of the token / sequence rules; None: 1 / rejection_threshold"},
    )
    off_policy_sequence_mask_delta: float | None = field(
        default=None,
        metadata={
            "help": "drop negative-advantage tokens of samples whose mean log(pi_rollout / pi) > delta"
        },
    )
    bypass: bool = field(
        default=False,
        metadata={"help": "rollout logprobs as the old policy (the PPO ratio is then the IS ratio)"},
    )
    log_ratio_clamp: float = field(
        default=20.0, metadata={"help": "|log ratio| cap before exp: e^20 is large but finite in fp32"}
    )

    def __post_init__(self) -> None:
        if self.is_mode is None:  # the 'off' of Python callers; the command line says 'none'
            object.__setattr__(self, "is_mode", "none")
        self._check_clip()
        self._check_kl()
        self._check_is()
        self._check_rejection()

    def _check_clip(self) -> None:
        if not 0 < self.epsilon < 1:
            raise ValueError(f"LossConfig.epsilon must be in (0, 1), got {self.epsilon!r}")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ValueError(f"LossConfig.epsilon_high must be > 0 or None, got {self.epsilon_high!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"LossConfig.dual_clip must be > 1 or None, got {self.dual_clip!r}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"LossConfig.policy_loss must be one of {tuple(POLICY_LOSSES)} (register_policy_loss "
                f"adds one), got {self.policy_loss!r}"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"LossConfig.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}"
            )
        if self.loss_scale_factor is not None and not self.loss_scale_factor > 0:
            raise ValueError(
                f"LossConfig.loss_scale_factor must be > 0 or None, got {self.loss_scale_factor!r}"
            )
        if self.aggregation == "seq-mean-token-sum-norm" and self.loss_scale_factor is None:
            raise ValueError(
                "LossConfig.loss_scale_factor must be set for aggregation 'seq-mean-token-sum-norm' "
                "(a constant such as the maximum completion length), got None"
            )
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"LossConfig.log_ratio_clamp must be > 0, got {self.log_ratio_clamp!r}")

    def _check_kl(self) -> None:
        if not self.beta >= 0:
            raise ValueError(f"LossConfig.beta must be >= 0, got {self.beta!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"LossConfig.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )
        if self.kl_clamp is not None and not self.kl_clamp > 0:
            raise ValueError(f"LossConfig.kl_clamp must be > 0 or None, got {self.kl_clamp!r}")

    def _check_is(self) -> None:
        if self.is_mode not in IS_MODES:
            raise ValueError(f"LossConfig.is_mode must be one of {IS_MODES} or None, got {self.is_mode!r}")
        if not self.is_threshold > 0:
            raise ValueError(f"LossConfig.is_threshold must be > 0, got {self.is_threshold!r}")
        low = self.is_threshold_low
        if low is not None and not 0 < low < self.is_threshold:
            raise ValueError(
                f"LossConfig.is_threshold_low must be in (0, is_threshold={self.is_threshold}) or None, "
                f"got {low!r}"
            )
        if self.is_sequence_weight not in SEQUENCE_WEIGHTS:
            raise ValueError(
                f"LossConfig.is_sequence_weight must be one of {SEQUENCE_WEIGHTS}, "
                f"got {self.is_sequence_weight!r}"
            )
        if self.is_batch_normalize and self.is_mode == "none":
            raise ValueError("LossConfig.is_batch_normalize must be False when is_mode is 'none', got True")
        if self.bypass and self.is_mode != "none":
            raise ValueError(
                f"LossConfig.is_mode must be 'none' when bypass=True, got {self.is_mode!r}: the rollout "
                "policy is then the old policy, so the clipped PPO ratio already is the IS correction"
            )

    def _check_rejection(self) -> None:
        if self.rejection not in REJECTIONS:
            raise ValueError(f"LossConfig.rejection must be one of {REJECTIONS}, got {self.rejection!r}")
        hi, low = self.rejection_threshold, self.rejection_threshold_low
        if self.rejection == "none":
            if hi is not None or low is not None:
                raise ValueError(
                    "LossConfig.rejection_threshold must be None when rejection is 'none', "
                    f"got rejection_threshold={hi!r}, rejection_threshold_low={low!r}"
                )
        elif hi is None or not hi > 0:
            raise ValueError(
                f"LossConfig.rejection_threshold must be > 0 for rejection {self.rejection!r}, got {hi!r}"
            )
        elif self.rejection in ("token", "sequence"):
            lo = 1 / hi if low is None else low
            if not 0 < lo < hi:
                raise ValueError(
                    f"LossConfig.rejection_threshold_low must be in (0, rejection_threshold={hi}) "
                    f"(None: 1 / rejection_threshold), got {low!r}"
                )
        elif low is not None:
            raise ValueError(
                f"LossConfig.rejection_threshold_low must be None for rejection {self.rejection!r} "
                f"(a one-sided KL bound), got {low!r}"
            )
        delta = self.off_policy_sequence_mask_delta
        if delta is not None and not delta >= 0:
            raise ValueError(f"LossConfig.off_policy_sequence_mask_delta must be >= 0 or None, got {delta!r}")

    @property
    def rejects(self) -> bool:
        """Whether a rule removes tokens (so the denominators need `loss_token_mask`)."""
        return self.rejection != "none" or self.off_policy_sequence_mask_delta is not None


def _complete(logprobs_complete: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the position's sample has usable rollout logprobs."""
    return torch.where(sample_ids >= 0, logprobs_complete[sample_ids.clamp(min=0)], False)


def _finite(logprobs, rollout_logprobs, complete, *extra) -> torch.Tensor:
    """[B, T] bool: every logprob the loss reads at the position is finite.

    Rollout logprobs of an incomplete sample are never read (they may be NaN placeholders).
    """
    finite = torch.isfinite(logprobs) & (torch.isfinite(rollout_logprobs) | ~complete)
    for t in extra:
        if t is not None:
            finite &= torch.isfinite(t)
    return finite


def _rejected(diff_c, measured, sample_ids, advantages, config: LossConfig) -> torch.Tensor:
    """[B, T] bool: measured tokens that the rejection rules remove."""
    out = torch.zeros_like(measured)
    if config.rejection != "none":
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


def _log_ratio(train, rollout, where, clamp) -> torch.Tensor:
    """[B, T] log pi_train - log pi_rollout, clamped, 0 off `where` (no gradient)."""
    return torch.where(where, train.detach().float() - rollout.float(), 0.0).clamp(-clamp, clamp)


def _weights(diff_c, corrected, sample_ids, segment_ids, config: LossConfig):
    groups = sample_ids if config.is_mode.startswith("sequence") else segment_ids
    return importance_weights(
        diff_c,
        corrected,
        mode=config.is_mode,
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
    _check(
        logprobs, {"ref_logprobs": ref_logprobs, "loss_mask": batch.loss_mask}, batch.logprobs_complete, 1, 1
    )
    mask = batch.loss_mask.bool()
    complete = _complete(batch.logprobs_complete, batch.sample_ids)
    finite = _finite(logprobs, batch.rollout_logprobs, complete, ref_logprobs)
    measured = mask & finite & complete
    diff_c = _log_ratio(logprobs, batch.rollout_logprobs, measured, config.log_ratio_clamp)
    return mask & finite & ~_rejected(diff_c, measured, batch.sample_ids, batch.advantages, config)


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
    corrected = mask & _complete(batch.logprobs_complete, batch.sample_ids)
    diff_c = _log_ratio(logprobs, batch.rollout_logprobs, corrected, config.log_ratio_clamp)
    weights, _, _ = _weights(diff_c, corrected, batch.sample_ids, batch.segment_ids, config)
    return torch.stack([torch.where(corrected, weights, 0.0).sum().double(), corrected.sum().double()])


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
    if config.is_mode.startswith("turn") and segment_ids is None:
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
    mask = loss_mask.bool()
    complete = _complete(logprobs_complete, sample_ids)  # [B, T]
    finite = _finite(logprobs, rollout_logprobs, complete, old_logprobs, ref_logprobs)
    train_raw = old_logprobs if old_logprobs is not None else logprobs.detach()
    measured = mask & finite & complete  # tokens whose train and rollout logprobs are both known
    diff_c = _log_ratio(train_raw, rollout_logprobs, measured, c)
    if token_mask is None:
        rejected = _rejected(diff_c, measured, sample_ids, advantages, config)
    else:
        rejected = mask & finite & ~token_mask
    valid = mask & finite & ~rejected
    compared = valid & complete

    def clean(t: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return torch.where(where, t.float(), 0.0)

    lp = clean(logprobs, valid)  # [B, T]; gradient flows only through valid tokens
    train = clean(train_raw, valid).detach()
    rollout = clean(rollout_logprobs, compared)

    correcting = config.bypass or config.is_mode != "none"
    corrected = compared if correcting else torch.zeros_like(compared)
    weights = torch.ones_like(lp)
    truncated = masked = torch.zeros_like(mask)
    if config.is_mode != "none":
        weights, truncated, masked = _weights(
            torch.where(compared, diff_c, 0.0), compared, sample_ids, segment_ids, config
        )
        if config.is_batch_normalize:
            weights = torch.where(compared, weights / float(is_weight_mean), weights)
    old = torch.where(compared, rollout, train) if config.bypass else train

    adv = torch.where(valid, advantages.float(), 0.0)
    inputs = PolicyInputs(
        logprobs=lp, old_logprobs=old, advantages=adv, valid=valid, sample_ids=sample_ids, num_samples=n
    )
    terms = POLICY_LOSSES[config.policy_loss](inputs, config)
    policy = torch.where(valid, weights * terms.per_token, 0.0)

    kl = torch.zeros_like(lp)
    if ref_logprobs is not None:
        est = kl_penalty(lp, clean(ref_logprobs, valid), config.kl_estimator, c, config.kl_clamp)
        kl = torch.where(valid, est, kl)

    def agg(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate(
            per_token,
            valid,
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
    loss = policy_loss + kl_loss

    present = unit_sums(mask.float(), mask, sample_ids, n) > 0  # [N] samples with loss tokens here
    is_weight = torch.where(compared, torch.exp(diff_c), 1.0) if config.bypass else weights
    metrics = _metric_sums(
        {
            "loss/policy": policy_loss,
            "loss/kl": kl_loss,
            "tokens": mask,
            "tokens_kept": valid,
            "samples": present,
            "samples_complete": present & logprobs_complete,
            "nonfinite_masked": mask & ~finite,
            "clip/tokens_clipped": terms.clipped & valid,
            "clip/tokens_dual_clipped": terms.dual_clipped & valid,
            "kl/ref_sum": kl,
            "ppo_kl_sum": torch.where(valid, old - lp.detach(), 0.0),  # k1 of KL(old || train)
            "is/samples_corrected": present & logprobs_complete & correcting,
            "is/tokens_corrected": corrected,
            "is/tokens_compared": measured,
            "is/tokens_truncated": truncated,
            "is/tokens_masked": masked,
            "is/tokens_rejected": rejected,
            "is/weight_sum": torch.where(corrected, is_weight, 0.0),
            "is/weight_sq_sum": torch.where(corrected, is_weight * is_weight, 0.0),
        }
    )
    rollout_m = clean(rollout_logprobs, measured)
    metrics.update(
        diagnostics.off_policy_sums(clean(train_raw, measured), rollout_m, measured, sample_ids, n, c)
    )
    metrics["ratio/max"] = torch.where(valid, terms.ratio, 0.0).max().detach().float()
    metrics["is/weight/max"] = torch.where(corrected, is_weight, 0.0).max().detach().float()
    metrics["is/weight/min"] = torch.where(corrected, is_weight, math.inf).min().detach().float()
    return loss, {k: v.detach().float() for k, v in metrics.items()}


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


def _reduction(key: str) -> str:
    return "max" if key.endswith("/max") else "min" if key.endswith("/min") else "sum"


def merge_metrics(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Combine two calls' metrics: sum, max for keys ending in '/max', min for '/min'."""
    if a.keys() != b.keys():
        raise ValueError(f"metrics must have the same keys, got {sorted(a.keys() ^ b.keys())} in only one")
    ops = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}
    return {k: ops[_reduction(k)](a[k], b[k]) for k in a}


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
    return {k: torch.tensor(math.inf if _reduction(k) == "min" else 0.0) for k in m}


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
