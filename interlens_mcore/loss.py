"""GRPO objective with rollout-vs-train importance-sampling (IS) correction. Pure tensor math.

Every [B, T] tensor is on target positions (see `batch.py`). The loss returned by one call is
already divided by the *global* denominators the caller passes (`num_tokens`, `num_sequences`,
counted over every micro-batch and rank whose gradients are summed), so summing the calls'
losses gives the batch loss. Metrics are raw sums (maxima for keys ending in `/max`) to be
reduced once across micro-batches and ranks; `finalize_metrics` turns them into means.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from interlens_mcore.batch import TrainingBatch

KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
IS_MODES = (
    None,
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "turn_truncate",
    "turn_mask",
)


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Knobs of `grpo_loss`."""

    epsilon: float = 0.2  # ratio clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # clip-higher (DAPO); None means epsilon
    dual_clip: float | None = None  # for A < 0, cap the loss at -A * dual_clip (> 1)
    beta: float = 0.0  # coefficient of KL(train || reference); needs ref_logprobs when > 0
    kl_estimator: str = "k3"  # 'k1' | 'k2' | 'k3' (k3: low-variance, always >= 0)
    aggregation: str = "token-mean"  # 'token-mean' | 'seq-mean-token-mean' | 'seq-mean-token-sum'
    is_mode: str | None = None  # rollout IS correction, see IS_MODES; None: diagnostics only
    is_threshold: float = 2.0  # truncate IS weights at it, or mask those above it
    bypass: bool = False  # use rollout logprobs as the old policy (the PPO ratio is then the IS ratio)
    log_ratio_clamp: float = 20.0  # |log ratio| cap before exp: e^20 is large but finite in fp32

    def __post_init__(self) -> None:
        if not 0 < self.epsilon < 1:
            raise ValueError(f"LossConfig.epsilon must be in (0, 1), got {self.epsilon!r}")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ValueError(f"LossConfig.epsilon_high must be > 0 or None, got {self.epsilon_high!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"LossConfig.dual_clip must be > 1 or None, got {self.dual_clip!r}")
        if not self.beta >= 0:
            raise ValueError(f"LossConfig.beta must be >= 0, got {self.beta!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"LossConfig.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"LossConfig.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}"
            )
        if self.is_mode not in IS_MODES:
            raise ValueError(f"LossConfig.is_mode must be one of {IS_MODES}, got {self.is_mode!r}")
        if not self.is_threshold > 0:
            raise ValueError(f"LossConfig.is_threshold must be > 0, got {self.is_threshold!r}")
        if self.bypass and self.is_mode is not None:
            raise ValueError(
                "LossConfig.is_mode must be None when bypass=True: the rollout policy is then the "
                "old policy, so the clipped PPO ratio already is the IS correction"
            )
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"LossConfig.log_ratio_clamp must be > 0, got {self.log_ratio_clamp!r}")


def importance_weights(
    log_ratio: torch.Tensor,
    corrected: torch.Tensor,
    *,
    mode: str,
    threshold: float,
    group_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IS weights pi_train / pi_rollout, and which tokens were truncated or masked.

    log_ratio [B, T]: log pi_train - log pi_rollout, clamped by the caller, 0 where not
    `corrected` [B, T] bool. For sequence and turn modes, `group_ids` [B, T] (sample ids, or
    segment ids) name the unit whose weight is exp(mean log-ratio over its corrected tokens),
    the geometric mean of the token ratios, shared by all its tokens.
    Truncate: min(w, threshold). Mask: 0 where w > threshold (the unit is dropped).
    Returns weights [B, T] float32 (1.0 where not corrected), truncated [B, T], masked [B, T].
    """
    if mode not in IS_MODES[1:]:
        raise ValueError(f"mode must be one of {IS_MODES[1:]}, got {mode!r}")
    lr = log_ratio.detach().float()
    if not mode.startswith("token"):
        if group_ids is None or group_ids.shape != lr.shape:
            raise ValueError(f"group_ids must be [B, T] like log_ratio for mode {mode!r}")
        if bool((group_ids[corrected] < 0).any()):
            raise ValueError(f"group_ids must be >= 0 on every corrected token for mode {mode!r}")
        units, inverse = torch.unique(group_ids[corrected], return_inverse=True)
        sums = lr.new_zeros(units.numel()).index_add_(0, inverse, lr[corrected])
        counts = lr.new_zeros(units.numel()).index_add_(0, inverse, lr.new_ones(inverse.numel()))
        lr = torch.zeros_like(lr).masked_scatter_(corrected, (sums / counts)[inverse])
    w = torch.exp(lr)
    over = corrected & (w > threshold)
    if mode.endswith("truncate"):
        weights, truncated, masked = w.clamp(max=threshold), over, torch.zeros_like(over)
    else:
        weights, truncated, masked = torch.where(over, torch.zeros_like(w), w), torch.zeros_like(over), over
    return torch.where(corrected, weights, torch.ones_like(weights)), truncated, masked


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str, clamp: float
) -> torch.Tensor:
    """Per-token estimate of KL(train || reference) from samples of the train policy."""
    d = (ref_logprobs - logprobs).clamp(-clamp, clamp)  # log(pi_ref / pi)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def _aggregate(per_token, mask, sample_ids, num_samples, aggregation, num_tokens, num_sequences):
    """Sum of `per_token` (0 off `mask`) under `aggregation`, with the global denominators."""
    if aggregation == "token-mean":
        return per_token.sum() / num_tokens
    if aggregation == "seq-mean-token-sum":
        return per_token.sum() / num_sequences
    # seq-mean-token-mean: each sample's mean over its own loss tokens (all in this call).
    bucket = torch.where(sample_ids >= 0, sample_ids, num_samples).flatten()  # padding -> spare slot
    sums = per_token.new_zeros(num_samples + 1).index_add_(0, bucket, per_token.flatten())
    counts = per_token.new_zeros(num_samples + 1).index_add_(0, bucket, mask.flatten().to(per_token.dtype))
    return (sums / counts.clamp(min=1))[:num_samples].sum() / num_sequences


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped GRPO loss of one micro-batch and its metric sums.

    logprobs [B, T]: train-policy logprobs of the targets (differentiable). The other [B, T]
    tensors come from `TrainingBatch`; logprobs_complete [N] is indexed by `sample_ids`.
    old_logprobs default to logprobs.detach() (one update per rollout). IS correction applies
    to the tokens of samples whose `logprobs_complete` is True, and only to them: the decision
    is per sample and never depends on other samples of the call. Any loss token with a
    non-finite logprob (train, old, reference, or rollout of a complete sample) is dropped
    from the loss through `torch.where` (NaN * 0 is NaN) and counted in `nonfinite_masked`.
    Sequence and turn IS modes and 'seq-mean-token-mean' need each sample entirely in this call.
    """
    named = {
        "loss_mask": loss_mask,
        "advantages": advantages,
        "rollout_logprobs": rollout_logprobs,
        "sample_ids": sample_ids,
        "segment_ids": segment_ids,
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
    }
    _check(logprobs, named, logprobs_complete, num_tokens, num_sequences)
    if config.beta > 0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs are required when LossConfig.beta > 0 (beta={config.beta})")
    if config.is_mode is not None and config.is_mode.startswith("turn") and segment_ids is None:
        raise ValueError(f"segment_ids are required for is_mode {config.is_mode!r}")

    c = config.log_ratio_clamp
    n = logprobs_complete.numel()
    mask = loss_mask.bool()
    complete = torch.where(sample_ids >= 0, logprobs_complete[sample_ids.clamp(min=0)], False)  # [B, T]
    finite = torch.isfinite(logprobs) & (torch.isfinite(rollout_logprobs) | ~complete)
    for extra in (old_logprobs, ref_logprobs):
        if extra is not None:
            finite &= torch.isfinite(extra)
    valid = mask & finite
    compared = valid & complete  # tokens whose train and rollout logprobs are both known

    def clean(t: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return torch.where(where, t.float(), 0.0)

    lp = clean(logprobs, valid)  # [B, T]; gradient flows only through valid tokens
    train = clean(old_logprobs, valid) if old_logprobs is not None else lp.detach()
    rollout = clean(rollout_logprobs, compared)
    diff = torch.where(compared, train - rollout, 0.0)  # [B, T] log pi_train - log pi_rollout
    diff_c = diff.clamp(-c, c)

    correcting = config.bypass or config.is_mode is not None
    corrected = compared if correcting else torch.zeros_like(compared)
    ones = torch.ones_like(lp)
    truncated = masked = torch.zeros_like(mask)
    weights = ones
    old = torch.where(compared, rollout, train) if config.bypass else train
    if config.is_mode is not None:
        groups = sample_ids if config.is_mode.startswith("sequence") else segment_ids
        weights, truncated, masked = importance_weights(
            diff_c, compared, mode=config.is_mode, threshold=config.is_threshold, group_ids=groups
        )

    adv = advantages.float()
    ratio = torch.exp((lp - old).clamp(-c, c))
    eps_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1 - config.epsilon, 1 + eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = valid & (pg2 > pg1)
    dual = torch.zeros_like(mask)
    if config.dual_clip is not None:
        cap = -adv * config.dual_clip  # > 0 exactly where A < 0
        dual = valid & (adv < 0) & (pg > cap)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    policy = torch.where(valid, weights * pg, 0.0)

    kl = torch.zeros_like(lp)
    if ref_logprobs is not None:
        kl = torch.where(valid, kl_penalty(lp, clean(ref_logprobs, valid), config.kl_estimator, c), kl)

    def agg(per_token: torch.Tensor) -> torch.Tensor:
        return _aggregate(per_token, mask, sample_ids, n, config.aggregation, num_tokens, num_sequences)

    policy_loss = agg(policy)
    kl_loss = agg(config.beta * kl) if config.beta > 0 else policy_loss.new_zeros(())
    loss = policy_loss + kl_loss

    bucket = torch.where(sample_ids >= 0, sample_ids, n).flatten()
    present = mask.new_zeros(n + 1, dtype=torch.long).index_add_(0, bucket, mask.flatten().long())[:n] > 0
    is_weight = torch.exp(diff_c) if config.bypass else weights
    metrics = _metric_sums(
        {
            "loss/policy": policy_loss,
            "loss/kl": kl_loss,
            "tokens": mask,
            "samples": present,
            "samples_complete": present & logprobs_complete,
            "nonfinite_masked": mask & ~finite,
            "clip/tokens_clipped": clipped,
            "clip/tokens_dual_clipped": dual,
            "kl/ref_sum": kl,
            "is/samples_corrected": present & logprobs_complete & correcting,
            "is/tokens_corrected": corrected,
            "is/tokens_compared": compared,
            "is/tokens_truncated": truncated,
            "is/tokens_masked": masked,
            "is/weight_sum": torch.where(corrected, is_weight, 0.0),
            "is/kl_k1_sum": -diff,  # KL(rollout || train) sampled from the rollout policy
            "is/kl_k3_sum": torch.where(compared, torch.exp(diff_c) - 1 - diff_c, 0.0),
            "is/abs_logprob_diff_sum": diff.abs(),
        }
    )
    metrics["ratio/max"] = torch.where(valid, ratio, 0.0).max().detach()
    metrics["is/weight/max"] = torch.where(corrected, is_weight, 0.0).max().detach()
    return loss, metrics


def _metric_sums(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().sum() for k, v in values.items()}


def batch_loss(
    logprobs: torch.Tensor, batch: TrainingBatch, config: LossConfig, **kwargs
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`grpo_loss` on a whole `TrainingBatch` (kwargs: old/ref logprobs, global denominators)."""
    return grpo_loss(
        logprobs,
        loss_mask=batch.loss_mask,
        advantages=batch.advantages,
        rollout_logprobs=batch.rollout_logprobs,
        logprobs_complete=batch.logprobs_complete,
        sample_ids=batch.sample_ids,
        segment_ids=batch.segment_ids,
        config=config,
        **kwargs,
    )


def merge_metrics(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Combine two calls' metrics: sum, or max for keys ending in '/max'."""
    if a.keys() != b.keys():
        raise ValueError(f"metrics must have the same keys, got {sorted(a.keys() ^ b.keys())} in only one")
    return {k: torch.maximum(a[k], b[k]) if k.endswith("/max") else a[k] + b[k] for k in a}


def finalize_metrics(sums: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Means and fractions from reduced metric sums (a fraction over nothing is reported as 0)."""
    s = {k: float(v) for k, v in sums.items()}

    def frac(num: str, den: str) -> float:
        return s[num] / s[den] if s[den] > 0 else 0.0

    return {
        "loss/policy": s["loss/policy"],
        "loss/kl": s["loss/kl"],
        "tokens": s["tokens"],
        "samples": s["samples"],
        "nonfinite_masked": s["nonfinite_masked"],
        "clip/fraction": frac("clip/tokens_clipped", "tokens"),
        "clip/dual_fraction": frac("clip/tokens_dual_clipped", "tokens"),
        "ratio/max": s["ratio/max"],
        "kl/ref": frac("kl/ref_sum", "tokens"),
        "is/complete_fraction": frac("samples_complete", "samples"),
        "is/sample_fraction": frac("is/samples_corrected", "samples"),
        "is/token_fraction": frac("is/tokens_corrected", "tokens"),
        "is/weight_mean": frac("is/weight_sum", "is/tokens_corrected"),
        "is/weight/max": s["is/weight/max"],
        "is/truncated_fraction": frac("is/tokens_truncated", "is/tokens_corrected"),
        "is/masked_fraction": frac("is/tokens_masked", "is/tokens_corrected"),
        "is/kl_k1": frac("is/kl_k1_sum", "is/tokens_compared"),
        "is/kl_k3": frac("is/kl_k3_sum", "is/tokens_compared"),
        "is/abs_logprob_diff": frac("is/abs_logprob_diff_sum", "is/tokens_compared"),
    }
