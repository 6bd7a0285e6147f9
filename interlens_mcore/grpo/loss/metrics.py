"""The loss metrics: their keys, the one rule by which each reduces, and the logged figures.

`grpo_loss` returns raw per-call values under the keys declared here. A key reduces over
micro-batches and ranks by its suffix: '/max' by max, '/min' by min, any other by sum
(`reduction`); `merge_metrics` (micro-batches) and the trainer's all-reduce (ranks) both read
that rule. `empty_metrics` gives a rank that trained on nothing the neutral value of every key,
and `finalize_metrics` turns reduced sums into the logged means and fractions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

import torch

from interlens_mcore.grpo.loss import diagnostics

Reduction = Literal["sum", "max", "min"]
REDUCTIONS: tuple[Reduction, ...] = ("sum", "max", "min")

# every key of `grpo_loss`'s metrics, whatever the LossConfig (a test checks they agree)
SUM_KEYS = (
    "loss/policy",
    "loss/kl",
    "tokens",
    "tokens_kept",
    "samples",
    "samples_complete",
    "nonfinite_masked",
    "clip/tokens_clipped",
    "clip/tokens_dual_clipped",
    "kl/ref_sum",
    "ppo_kl_sum",
    "is/samples_corrected",
    "is/tokens_corrected",
    "is/tokens_compared",
    "is/tokens_truncated",
    "is/tokens_masked",
    "is/tokens_rejected",
    "is/weight_sum",
    "is/weight_sq_sum",
)
EXTREMUM_KEYS = ("ratio/max", "is/weight/max", "is/weight/min")
METRIC_KEYS = (*SUM_KEYS, *diagnostics.SUM_KEYS, *diagnostics.SPREAD_KEYS, *EXTREMUM_KEYS)

_MERGE: dict[Reduction, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add,
    "max": torch.maximum,
    "min": torch.minimum,
}
_NEUTRAL: dict[Reduction, float] = {"sum": 0.0, "max": 0.0, "min": math.inf}


def reduction(key: str) -> Reduction:
    """How a metric reduces over micro-batches and ranks: by its key's suffix ('/max', '/min'), else sum."""
    return "max" if key.endswith("/max") else "min" if key.endswith("/min") else "sum"


def keys_by_reduction(keys: Iterable[str]) -> dict[Reduction, list[str]]:
    """The keys (sorted) that reduce by each reduction; every reduction is present, maybe empty."""
    out: dict[Reduction, list[str]] = {op: [] for op in REDUCTIONS}
    for key in sorted(keys):
        out[reduction(key)].append(key)
    return out


def merge_metrics(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Combine two calls' metrics: sum, max for keys ending in '/max', min for '/min'."""
    if a.keys() != b.keys():
        raise ValueError(f"metrics must have the same keys, got {sorted(a.keys() ^ b.keys())} in only one")
    return {k: _MERGE[reduction(k)](a[k], b[k]) for k in a}


def empty_metrics() -> dict[str, torch.Tensor]:
    """Every metric key of `grpo_loss` at the neutral value of its reduction (0, or +inf for '/min').

    For a rank that trained on nothing but joins the reductions; the key set is the same for
    every `LossConfig`.
    """
    return {k: torch.tensor(_NEUTRAL[reduction(k)], dtype=torch.float64) for k in METRIC_KEYS}


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
