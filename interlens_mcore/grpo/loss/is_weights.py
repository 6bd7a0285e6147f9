"""Rollout importance sampling: weights pi_train / pi_rollout, and rejection of off-policy tokens.

Every function takes the per-token log-ratio d = log pi_train - log pi_rollout [B, T] (0 where
not `corrected`/`compared`) and returns [B, T] tensors. `importance_weights` takes d unclamped
and bounds it itself (see `unit_log_weight`); the rejection rules take d clamped. Units
(sample, turn) are named by id tensors [B, T]; a unit's figure uses only its own tokens, so a
unit must lie entirely in the call. Nothing here has a gradient: weights are constants.

Weights (`importance_weights`) multiply the loss; rejection (`rejection_mask`,
`off_policy_sequence_mask`) removes tokens from the loss *and* from the denominators, which is
why it is decided once, before the backward pass, by `loss.loss_token_mask`.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from interlens_mcore.grpo.loss.aggregation import broadcast, unit_means, unit_sums

IsMode = Literal[
    "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "turn_truncate", "turn_mask"
]
IS_MODES: tuple[str, ...] = get_args(IsMode)
SequenceWeight = Literal["geometric", "product"]
SEQUENCE_WEIGHTS: tuple[str, ...] = get_args(SequenceWeight)
Rejection = Literal["none", "token", "sequence", "sequence_k1", "sequence_k3"]
REJECTIONS: tuple[str, ...] = get_args(Rejection)


def _check_units(
    unit_ids: torch.Tensor | None, like: torch.Tensor, where: torch.Tensor, what: str
) -> torch.Tensor:
    """`unit_ids`, checked: [B, T] like `like`, >= 0 wherever `where`."""
    if unit_ids is None or unit_ids.shape != like.shape:
        raise ValueError(f"group_ids must be [B, T] like log_ratio for {what}")
    if bool((unit_ids[where] < 0).any()):
        raise ValueError(f"group_ids must be >= 0 on every corrected token for {what}")
    return unit_ids


def unit_log_weight(
    log_ratio: torch.Tensor, where: torch.Tensor, unit_ids: torch.Tensor, form: str, clamp: float
) -> torch.Tensor:
    """[B, T] float64 log weight of each position's unit, within +-clamp; `log_ratio` unclamped.

    geometric: the mean of the token log-ratios, each clamped to +-clamp first. product: the
    sum of the unclamped token log-ratios, clamped as a whole (in float64, so a sum of huge
    finite values cannot overflow to inf - inf = NaN). The product is thus the exact product
    of the token ratios whenever that lies in [e^-clamp, e^clamp], and agrees with
    `is/chi2_seq`, which bounds the same sum: log-ratios +41 and -38 give e^3, not e^0.
    """
    if form not in SEQUENCE_WEIGHTS:
        raise ValueError(f"form must be one of {SEQUENCE_WEIGHTS}, got {form!r}")
    d = log_ratio.double()
    n = int(unit_ids.max()) + 1 if unit_ids.numel() else 0
    if form == "geometric":
        per_unit, _ = unit_means(d.clamp(-clamp, clamp), where, unit_ids, n)
    else:
        per_unit = unit_sums(d, where, unit_ids, n).clamp(-clamp, clamp)
    return torch.where(where, broadcast(per_unit, unit_ids), torch.zeros_like(d))


def importance_weights(
    log_ratio: torch.Tensor,
    corrected: torch.Tensor,
    *,
    mode: str,
    threshold: float,
    group_ids: torch.Tensor | None = None,
    threshold_low: float | None = None,
    sequence_weight: str = "geometric",
    clamp: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IS weights pi_train / pi_rollout, and which tokens were truncated or masked.

    log_ratio [B, T]: d unclamped (finite), 0 where not `corrected` [B, T] bool. Token modes
    clamp each d to +-clamp; for sequence and turn modes,
    `group_ids` [B, T] (sample ids, or segment ids) name the unit whose weight every one of
    its tokens shares: exp(mean d) (geometric mean of the token ratios) or exp(sum d)
    (their product), per `sequence_weight`, bounded as `unit_log_weight` says.
    Truncate: w clamped to [threshold_low, threshold]. Mask: 0 where w > threshold or
    w < threshold_low (the unit is dropped). threshold_low None means no lower bound.
    Returns weights [B, T] float32 (1.0 where not corrected), truncated [B, T], masked [B, T].
    """
    if mode not in IS_MODES[1:]:
        raise ValueError(f"mode must be one of {IS_MODES[1:]}, got {mode!r}")
    lr = log_ratio.detach().double()
    if mode.startswith("token"):
        lr = lr.clamp(-clamp, clamp)
    else:
        units = _check_units(group_ids, lr, corrected, f"mode {mode!r}")
        lr = unit_log_weight(lr, corrected, units, sequence_weight, clamp)
    w = torch.exp(lr).float()
    low = 0.0 if threshold_low is None else threshold_low
    out = corrected & ((w > threshold) | (w < low))
    none = torch.zeros_like(out)
    if mode.endswith("truncate"):
        weights, truncated, masked = w.clamp(min=low, max=threshold), out, none
    else:
        weights, truncated, masked = torch.where(out, torch.zeros_like(w), w), none, out
    return torch.where(corrected, weights, torch.ones_like(weights)), truncated, masked


def rejection_mask(
    log_ratio: torch.Tensor,
    compared: torch.Tensor,
    sample_ids: torch.Tensor,
    *,
    rule: str,
    threshold: float,
    threshold_low: float | None = None,
) -> torch.Tensor:
    """[B, T] bool: the `compared` tokens that `rule` rejects (removed from loss and denominators).

    token: the token ratio e^d lies outside [threshold_low, threshold]. sequence: the sample's
    geometric-mean ratio exp(mean d) lies outside it (every token of the sample goes).
    sequence_k1: |mean(-d)| > threshold, the k1 estimate of KL(rollout || train) in nats, either
    sign. sequence_k3: mean(e^d - 1 - d) > threshold (k3 >= 0). threshold_low None is
    1 / threshold for the ratio rules; the KL rules do not use it. The bounds are on
    pi_train / pi_rollout: verl's k1 rules bound pi_rollout / pi_train, so (threshold 1.5,
    threshold_low 0.8) here is its "0.667_1.25".
    """
    if rule not in REJECTIONS[1:]:
        raise ValueError(f"rule must be one of {REJECTIONS[1:]}, got {rule!r}")
    d = log_ratio.detach().float()
    low = 1.0 / threshold if threshold_low is None else threshold_low
    if rule == "token":
        w = torch.exp(d)
        return compared & ((w > threshold) | (w < low))
    _check_units(sample_ids, d, compared, f"rule {rule!r}")
    if rule == "sequence":
        w = torch.exp(unit_log_weight(d, compared, sample_ids, "geometric", float("inf")))
        return compared & ((w > threshold) | (w < low))
    per_token = -d if rule == "sequence_k1" else torch.exp(d) - 1 - d
    n = int(sample_ids.max()) + 1
    means, _ = unit_means(per_token, compared, sample_ids, n)
    bad = means.abs() > threshold
    return compared & broadcast(bad, sample_ids, fill=False)


def off_policy_sequence_mask(
    log_ratio: torch.Tensor,
    compared: torch.Tensor,
    sample_ids: torch.Tensor,
    advantages: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """[B, T] bool: tokens of negative advantage in samples whose mean(-d) exceeds `delta`.

    The off-policy sequence mask of DeepSeek-V3.2: a sample the train policy has drifted far
    from (k1 estimate of KL(rollout || train) above delta) is not pushed down further, while its
    positive-advantage tokens still train.
    """
    _check_units(sample_ids, log_ratio, compared, "the off-policy sequence mask")
    n = int(sample_ids.max()) + 1
    means, _ = unit_means(-log_ratio.detach().float(), compared, sample_ids, n)
    far = broadcast(means > delta, sample_ids, fill=False)
    return compared & far & (advantages < 0)
