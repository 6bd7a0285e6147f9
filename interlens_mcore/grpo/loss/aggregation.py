"""Per-token losses -> one number: the aggregation modes, and per-unit (sample, turn) sums.

Every mode divides by a *global* denominator the caller passes (`num_tokens`, `num_sequences`,
counted over every micro-batch and rank whose gradients are summed), so summing the calls'
results gives the batch's loss whatever the micro-batching. Per-unit means ('seq-mean-*') need
each unit entirely in the call, which `build_batch` guarantees for samples and turns.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"
]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def unit_sums(
    values: torch.Tensor, where: torch.Tensor, unit_ids: torch.Tensor, num_units: int
) -> torch.Tensor:
    """[U] sums of `values` [B, T] over the positions `where` [B, T] of each unit id in [0, U).

    Positions outside `where` or with a negative id (padding) never reach a unit, so a NaN or
    inf there cannot leak into a sum (they go to a spare slot that is dropped).
    """
    bucket = torch.where(where & (unit_ids >= 0), unit_ids, num_units).flatten()
    flat = torch.where(where, values, torch.zeros_like(values)).flatten()
    return flat.new_zeros(num_units + 1).index_add_(0, bucket, flat)[:num_units]


def unit_means(
    values: torch.Tensor, where: torch.Tensor, unit_ids: torch.Tensor, num_units: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([U] mean of `values` over each unit's `where` positions (0 for an empty unit), [U] counts)."""
    sums = unit_sums(values, where, unit_ids, num_units)
    counts = unit_sums(torch.ones_like(values), where, unit_ids, num_units)
    return sums / counts.clamp(min=1), counts


def broadcast(per_unit: torch.Tensor, unit_ids: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """[B, T] value of each position's unit (`fill` where the id is negative)."""
    picked = per_unit[unit_ids.clamp(min=0)]
    return torch.where(unit_ids >= 0, picked, torch.full_like(picked, fill))


def aggregate(
    per_token: torch.Tensor,
    valid: torch.Tensor,
    sample_ids: torch.Tensor,
    num_samples: int,
    *,
    mode: str,
    num_tokens: int | float | torch.Tensor,
    num_sequences: int | float | torch.Tensor,
    scale_factor: float | None = None,
) -> torch.Tensor:
    """The loss of `per_token` [B, T] (0 off `valid`) under `mode`, over the global denominators.

    token-mean: sum / num_tokens. token-sum: the sum itself. seq-mean-token-sum: sum /
    num_sequences. seq-mean-token-sum-norm (Dr. GRPO): sum / (num_sequences * scale_factor),
    a normaliser that does not move with the lengths. seq-mean-token-mean: each sample's mean
    over its own `valid` tokens, summed, / num_sequences.
    """
    if mode == "token-mean":
        return per_token.sum() / num_tokens
    if mode == "token-sum":
        return per_token.sum()
    if mode == "seq-mean-token-sum":
        return per_token.sum() / num_sequences
    if mode == "seq-mean-token-sum-norm":
        if scale_factor is None or not scale_factor > 0:
            raise ValueError(f"scale_factor must be > 0 for mode {mode!r}, got {scale_factor!r}")
        return per_token.sum() / (num_sequences * scale_factor)
    if mode == "seq-mean-token-mean":
        means, _ = unit_means(per_token, valid, sample_ids, num_samples)
        return means.sum() / num_sequences
    raise ValueError(f"mode must be one of {AGGREGATIONS}, got {mode!r}")
