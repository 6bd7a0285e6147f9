"""Advantage estimators and their registry: a group baseline per sample, then an optional batch step.

An estimator maps `AdvantageInputs` (one step's rewards on one rank) and its settings to
`Estimate`: the advantages before any batch-level statistic, the keep mask, and the `BatchStep`
that still has to run over the whole batch of every rank. Four are built in:

- 'grpo': r - group mean, divided by the group's std (`scale_rewards` "group", the default),
  the batch's std of the rewards ("batch", TRL) or nothing ("none", Dr. GRPO);
- 'rloo': r - the mean of the group's other samples; unscaled by default (verl, ms-swift);
- 'reinforce_plus_plus_baseline': r - group mean, then whitened over the batch's tokens (verl);
- 'reinforce_plus_plus': the reward itself (the return of every token for an outcome reward,
  gamma 1), whitened over the batch's tokens (verl).

A batch step needs statistics over all ranks, so it cannot run where the rewards are computed
(a local phase, no collectives): `batch_advantages` runs it later, with the caller's sum
all-reduce; which `BatchStep` an estimator returns must follow from its settings alone, never
from the data, or ranks would disagree on running it. Add an estimator with
`register_advantage_estimator`; `--advantage-estimator NAME` then selects it::

    @register_advantage_estimator("max_baseline", default_scale="none")
    def max_baseline(inputs: AdvantageInputs, settings: EstimatorSettings) -> Estimate:
        best = torch.zeros(int(inputs.groups.max()) + 1, dtype=torch.float64).scatter_reduce_(
            0, inputs.groups, inputs.rewards, "amax", include_self=False)
        adv = (inputs.rewards - best[inputs.groups]).float()
        return Estimate(advantages=adv, keep=torch.ones_like(adv, dtype=torch.bool))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from .advantages import group_advantages

Scale = Literal["group", "batch", "none"]
SCALES: tuple[Scale, ...] = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
WHITEN_EPS = 1e-8  # verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8)


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    """One rank's samples of a step that enter the baselines (failed and unscored ones are out)."""

    rewards: torch.Tensor  # [N] float64 weighted totals
    groups: torch.Tensor  # [N] int64 dense group ids 0..K-1, one per (prompt, seat)
    components: torch.Tensor  # [N, F] float64 each reward function's value, NaN where it gave none
    weights: torch.Tensor  # [F] float64 the reward functions' weights

    def __post_init__(self) -> None:
        n = self.rewards.shape[0]
        if self.groups.shape != (n,) or self.components.shape[0] != n:
            raise ValueError(
                f"AdvantageInputs: groups {tuple(self.groups.shape)} and components "
                f"{tuple(self.components.shape)} must have one row per reward ({n})"
            )
        if self.weights.shape != (self.components.shape[1],):
            raise ValueError(
                f"AdvantageInputs: {self.weights.numel()} weights for {self.components.shape[1]} components"
            )


@dataclass(frozen=True, kw_only=True)
class EstimatorSettings:
    """What the built-in estimators read, resolved from the rollout config (`settings_of`)."""

    scale: Scale  # the std the advantages are divided by
    leave_one_out: bool = False  # the baseline leaves the sample out (RLOO)
    drop_zero_variance: bool = False
    aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    eps: float = 1e-6


@dataclass(frozen=True, kw_only=True)
class BatchStep:
    """The part of an estimator over every rank's samples in the loss; run by `batch_advantages`.

    advantages <- (advantages - centre) / spread, where over the batch's kept samples, each
    weighing its trained tokens (`by_tokens`) or 1, of the values `of` ("advantages" or
    "rewards") m is the weighted mean and s^2 the weighted variance with Bessel's correction on
    the total weight: centre = m if `centre` else 0, spread = std + eps (`whiten` False) or
    sqrt(s^2 + 1e-8) (`whiten`, verl's masked_whiten).
    """

    of: Literal["advantages", "rewards"]
    centre: bool
    by_tokens: bool
    whiten: bool
    eps: float = 1e-6


@dataclass(frozen=True, kw_only=True)
class Estimate:
    advantages: torch.Tensor  # [N] float32, before the batch step
    keep: torch.Tensor  # [N] bool
    batch: BatchStep | None = None


EstimatorFn = Callable[[AdvantageInputs, EstimatorSettings], Estimate]


@dataclass(frozen=True, kw_only=True)
class Estimator:
    fn: EstimatorFn
    default_scale: Scale  # with --scale-rewards unset
    scales: tuple[Scale, ...]  # the --scale-rewards values it accepts
    leave_one_out: bool  # a sample needs another one in its group (its baseline)


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}


def register_advantage_estimator(
    name: str,
    *,
    default_scale: Scale = "group",
    scales: tuple[Scale, ...] = SCALES,
    leave_one_out: bool = False,
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator adding an advantage estimator under `name` (a name already taken is an error)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"advantage estimator name must be a non-empty string, got {name!r}")
    if default_scale not in scales or not set(scales) <= set(SCALES):
        raise ValueError(
            f"advantage estimator {name!r}: scales {scales} must be among {SCALES} "
            f"and hold default_scale {default_scale!r}"
        )

    def add(fn: EstimatorFn) -> EstimatorFn:
        if name in ADVANTAGE_ESTIMATORS:
            taken = ADVANTAGE_ESTIMATORS[name].fn.__qualname__
            raise ValueError(f"advantage estimator {name!r} is already registered ({taken})")
        ADVANTAGE_ESTIMATORS[name] = Estimator(
            fn=fn, default_scale=default_scale, scales=scales, leave_one_out=leave_one_out
        )
        return fn

    return add


def estimator(name: str, where: str = "advantage_estimator") -> Estimator:
    """The registered estimator `name`; a ValueError naming `where` and the registered names if none."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"{where} must be one of {tuple(ADVANTAGE_ESTIMATORS)} "
            f"(register_advantage_estimator adds one), got {name!r}"
        )
    return ADVANTAGE_ESTIMATORS[name]


def _baseline(inputs: AdvantageInputs, settings: EstimatorSettings, *, scale: bool) -> Estimate:
    adv, keep = group_advantages(
        inputs.rewards,
        inputs.groups,
        scale_by_std=scale,
        leave_one_out=settings.leave_one_out,
        drop_zero_variance=settings.drop_zero_variance,
        eps=settings.eps,
    )
    return Estimate(advantages=adv, keep=keep)


def _normalize_then_sum(inputs: AdvantageInputs, settings: EstimatorSettings) -> Estimate:
    """TRL's (GDPO's) multi-objective form: each reward function normalised in its group (its
    None values left out), the weighted sum of those, then centred and scaled over the batch."""
    total = torch.zeros_like(inputs.rewards)  # [N]
    for f in range(inputs.components.shape[1]):
        values = inputs.components[:, f]  # [N]
        given = ~torch.isnan(values)
        if given.any():
            a, _ = group_advantages(values[given], inputs.groups[given], scale_by_std=True, eps=settings.eps)
            total[given] += inputs.weights[f] * a.double()
    keep = _baseline(inputs, settings, scale=False).keep  # drop_zero_variance reads the totals
    step = BatchStep(of="advantages", centre=True, by_tokens=False, whiten=False, eps=settings.eps)
    return Estimate(advantages=total.float(), keep=keep, batch=step)


@register_advantage_estimator("grpo")
def grpo(inputs: AdvantageInputs, settings: EstimatorSettings) -> Estimate:
    """r - group mean (or RLOO's baseline with `leave_one_out`), scaled as `settings.scale` says."""
    if settings.aggregation == "normalize_then_sum":
        return _normalize_then_sum(inputs, settings)
    out = _baseline(inputs, settings, scale=settings.scale == "group")
    if settings.scale != "batch":
        return out
    step = BatchStep(of="rewards", centre=False, by_tokens=False, whiten=False, eps=settings.eps)
    return Estimate(advantages=out.advantages, keep=out.keep, batch=step)


@register_advantage_estimator("rloo", default_scale="none", leave_one_out=True)
def rloo(inputs: AdvantageInputs, settings: EstimatorSettings) -> Estimate:
    """r - the mean of the group's other samples = n / (n - 1) * (r - group mean)."""
    return grpo(inputs, dataclasses.replace(settings, leave_one_out=True))


@register_advantage_estimator("reinforce_plus_plus_baseline", default_scale="batch", scales=("batch",))
def reinforce_plus_plus_baseline(inputs: AdvantageInputs, settings: EstimatorSettings) -> Estimate:
    """r - group mean (never divided by the group's std), whitened over the batch's tokens."""
    out = _baseline(inputs, settings, scale=False)
    step = BatchStep(of="advantages", centre=True, by_tokens=True, whiten=True)
    return Estimate(advantages=out.advantages, keep=out.keep, batch=step)


@register_advantage_estimator("reinforce_plus_plus", default_scale="batch", scales=("batch",))
def reinforce_plus_plus(inputs: AdvantageInputs, settings: EstimatorSettings) -> Estimate:
    """The reward itself, every token's return for an outcome reward at gamma 1, whitened over the
    batch's tokens: the batch mean is the only baseline."""
    keep = _baseline(inputs, settings, scale=False).keep  # drop_zero_variance as for the others
    step = BatchStep(of="advantages", centre=True, by_tokens=True, whiten=True)
    return Estimate(advantages=inputs.rewards.float(), keep=keep, batch=step)


def batch_advantages(
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    weights: torch.Tensor,
    step: BatchStep,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`step` on this rank's advantages [N] (float32), with statistics over every rank's samples.

    rewards [N]: the samples' rewards; weights [N]: each sample's weight in the statistics (its
    trained tokens, or 1; 0 for a sample out of the loss). `reduce_sum` sums a float64 tensor
    over the ranks that share the batch (identity on one rank); it is called twice on every
    rank, in the same order: the mean first, then the squared deviations from it (two passes:
    sum of squares minus squared sum loses the variance to cancellation).
    """
    x = (advantages if step.of == "advantages" else rewards).double()  # [N]
    w = weights.double()  # [N]
    if x.shape != w.shape or advantages.shape != x.shape:
        raise ValueError(
            f"batch_advantages: advantages, rewards and weights must all be [N], got "
            f"{tuple(advantages.shape)}, {tuple(rewards.shape)}, {tuple(weights.shape)}"
        )
    first = reduce_sum(torch.stack([w.sum(), (w * x).sum()]))  # [2] total weight, weighted sum
    total = float(first[0])
    mean = float(first[1]) / total if total > 0 else 0.0
    second = reduce_sum((w * (x - mean) ** 2).sum().reshape(1))  # [1]
    # Bessel's correction on the total weight (verl's masked_var counts tokens); no spread below 2
    var = float(second[0]) / (total - 1) if total > 1 else 0.0
    spread = math.sqrt(var + WHITEN_EPS) if step.whiten else math.sqrt(var) + step.eps
    centre = mean if step.centre else 0.0
    return ((advantages.double() - centre) / spread).float()
