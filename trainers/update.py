"""The optimizer updates of one step: micro-batches through the loss, backward, one guarded step.

Collective over the DP group (denominators, metrics) and, through the backend, over TP: every
rank makes the same number of forward/backward calls, a rank without rows joining with a
zero-weighted placeholder batch so the gradient all-reduce stays aligned.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from interlens_mcore import distributed
from interlens_mcore.grpo.batch import Layout, TrainingBatch, build_batch
from interlens_mcore.grpo.loss.config import LossConfig
from interlens_mcore.grpo.loss.mask import denominators, is_weight_sums, loss_token_mask
from interlens_mcore.grpo.loss.metrics import (
    empty_metrics,
    finalize_metrics,
    keys_by_reduction,
    merge_metrics,
)
from interlens_mcore.grpo.loss.objective import batch_loss
from interlens_mcore.rollout.rollouter import Rollout
from interlens_mcore.types import Trajectory

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class Trainable(Protocol):
    """The part of a `Backend` an update uses."""

    @property
    def layout(self) -> Layout: ...

    @property
    def pad_to_multiple(self) -> int: ...

    def logprobs_of(self, batch: TrainingBatch, *, reference: bool = False) -> torch.Tensor: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def optimizer_step(self) -> float: ...


@dataclass(frozen=True)
class UpdateResult:
    """What one step's updates did."""

    metrics: dict[str, float]  # the loss metrics, reduced over the DP group and finalized
    skipped: int  # optimizer updates the backend did not apply (a non-finite gradient norm)


def update(
    backend: Trainable,
    batches: list[TrainingBatch | None],
    rollout: Rollout,
    *,
    loss_config: LossConfig,
    updates: int = 1,
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] = batch_loss,
    dp_group: ProcessGroup | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> UpdateResult:
    """`updates` optimizer steps on `batches` (None: this rank has no rows for that micro-batch).

    progress(done, total): called before each micro-batch's forward with gradient (local, for a
    progress display; `total` counts every update's micro-batches)."""
    # every figure below is taken at the trained positions (the loss mask): a backend that can
    # skip the others' output projection does so while the step runs
    backend.trained_only = True  # type: ignore[attr-defined]
    try:
        return _update(backend, batches, rollout, loss_config, updates, loss_fn, dp_group, progress)
    finally:
        backend.trained_only = False  # type: ignore[attr-defined]


def _update(
    backend: Trainable,
    batches: list[TrainingBatch | None],
    rollout: Rollout,
    loss_config: LossConfig,
    updates: int,
    loss_fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
    dp_group: ProcessGroup | None,
    progress: Callable[[int, int], None] | None,
) -> UpdateResult:
    cfg = loss_config
    placeholder = placeholder_batch(rollout.trajectories, backend)
    bonus = cfg.entropy_coeff > 0
    if bonus:  # the backends then give `token_entropy` with gradient on a policy forward
        backend.entropy_grad = True  # type: ignore[attr-defined]
    refs = [backend.logprobs_of(b, reference=True) if b and cfg.beta > 0 else None for b in batches]
    # Which tokens stay in the loss (non-finite logprobs and rejection rules remove some) must be
    # known before the first backward, since both global denominators leave them out. With one
    # micro-batch and one update, the forward of the update itself decides; otherwise a no-grad
    # pass over every micro-batch does (its logprobs are also the old policy's).
    # (`single` depends on the config alone: every rank takes the same path, collectives aligned)
    single = len(batches) == 1 and updates == 1
    entropies: list[torch.Tensor | None] = []  # the policy's, where the backend gives it
    if single:
        first = backend.logprobs_of(batches[0] or placeholder)
        old = [first.detach() if batches[0] else None]
        entropies.append(_entropy(backend, grad=bonus))
    else:
        old = []
        with torch.no_grad():
            for b in batches:
                old.append(backend.logprobs_of(b).detach() if b else None)
                entropies.append(getattr(backend, "token_entropy", None) if b else None)
    # old logprobs and masks are None exactly where the batch is
    masks = [
        loss_token_mask(b, o, cfg, ref_logprobs=r) if b is not None and o is not None else None
        for b, o, r in zip(batches, old, refs)
    ]
    # loss tokens, samples, IS weight sum, corrected tokens, entropy sum and its tokens
    counts = torch.zeros(6, dtype=torch.float64)
    for b, o, m, h in zip(batches, old, masks, entropies):
        if b is not None and o is not None and m is not None:
            counts[:2] += denominators(m, b)
            if cfg.is_batch_normalize:
                counts[2:4] += is_weight_sums(b, o, m, cfg)
            if h is not None and h.shape == m.shape:  # over the loss tokens
                kept = m.bool()
                counts[4] += float(h[kept].detach().double().sum())
                counts[5] += float(kept.sum())
    # global denominators: the loss of every micro-batch on every DP rank sums to the mean
    total = distributed.all_reduce(counts, group=dp_group).tolist()
    num_tokens, num_sequences, w_sum, w_count, entropy_sum, entropy_count = total
    entropy = {"entropy": entropy_sum / entropy_count} if entropy_count else {}
    if num_tokens == 0:  # nothing trainable anywhere (e.g. every group dropped or rejected)
        return UpdateResult({"grad_norm": 0.0, "skipped": 1.0, "step_skipped": 0.0, **entropy}, skipped=0)
    # top_entropy_quantile: decided here, before the first backward, from every DP rank's tokens
    high: list[torch.Tensor | None] = [None] * len(batches)
    if cfg.top_entropy_quantile < 1:
        high, entropy["entropy/masked_fraction"] = top_entropy_masks(
            masks, entropies, cfg.top_entropy_quantile, dp_group
        )
    extra = {"is_weight_mean": w_sum / w_count if w_count else 1.0} if cfg.is_batch_normalize else {}
    skipped, sums, grad_norm = 0, None, 0.0
    for k in range(updates):
        sums = None
        for i, batch in enumerate(batches):
            if progress is not None:
                progress(k * len(batches) + i + 1, updates * len(batches))
            real = batch is not None
            mb = batch if batch is not None else placeholder
            lp = first if single and k == 0 else backend.logprobs_of(mb)
            kwargs: dict[str, object] = {
                "old_logprobs": old[i] if updates > 1 and real else None,
                "ref_logprobs": refs[i] if real else (lp.detach() if cfg.beta > 0 else None),
                "token_mask": masks[i] if real else None,
                **extra,
            }
            if bonus:
                kwargs["entropy"] = entropies[0] if single and k == 0 else _entropy(backend, grad=True)
            if cfg.top_entropy_quantile < 1:
                kwargs["entropy_mask"] = high[i] if real else None
            loss, metrics = loss_fn(lp, mb, cfg, num_tokens=num_tokens, num_sequences=num_sequences, **kwargs)
            # a rank with no rows still joins the gradient all-reduce, contributing zero
            loss = loss if real else loss * 0.0
            if not torch.isfinite(loss.detach()):
                # A non-finite loss need not give non-finite gradients (a NaN added to the
                # loss has gradient 0). Scaled by NaN, every gradient that depends on the
                # parameters becomes NaN, even a zero one, and the DP all-reduce spreads it
                # to every rank, so the backend's one check of the global norm skips the
                # step everywhere together.
                loss = loss * float("nan")
            backend.backward(loss)
            if real:
                sums = metrics if sums is None else merge_metrics(sums, metrics)
        grad_norm = backend.optimizer_step()
        # the backend did not apply this update (see Backend.optimizer_step): count it
        skipped += not math.isfinite(grad_norm)
    reduced = reduce_metrics(sums, dp_group)
    figures = {**reduced, **entropy, "grad_norm": grad_norm, "step_skipped": float(skipped > 0)}
    return UpdateResult(figures, skipped)


def _entropy(backend: Trainable, *, grad: bool) -> torch.Tensor | None:
    """The backend's `token_entropy` of its last policy forward; with `grad`, it must carry one."""
    h = getattr(backend, "token_entropy", None)
    if grad and (h is None or not h.requires_grad):
        raise ValueError(
            f"--entropy-coeff > 0 needs the policy entropy with gradient, which the backend "
            f"{type(backend).__name__} does not give (token_entropy is "
            f"{'missing' if h is None else 'without gradient'})"
        )
    return h


def top_entropy_masks(
    masks: list[torch.Tensor | None],
    entropies: list[torch.Tensor | None],
    quantile: float,
    group: ProcessGroup | None,
) -> tuple[list[torch.Tensor | None], float]:
    """([B, T] masks of the loss tokens whose entropy is in the top `quantile` fraction, one per
    micro-batch; the fraction of loss tokens left out), collective over `group`.

    The threshold is the (1 - quantile) quantile (linear interpolation, as `torch.quantile`) of
    the entropies of every loss token of the step on every rank of `group`; a token at or above
    it gets the policy loss (TRL's `top_entropy_quantile`)."""
    local: list[torch.Tensor] = []
    for m, h in zip(masks, entropies):
        if m is None:
            continue
        if h is None or h.shape != m.shape:
            raise ValueError(
                "--top-entropy-quantile < 1 needs the policy entropy of every loss token, which the "
                f"backend does not give (token_entropy is {'missing' if h is None else tuple(h.shape)}, "
                f"the batch {tuple(m.shape)})"
            )
        local.append(h.detach()[m.bool()].float().cpu())
    mine = torch.cat(local) if local else torch.zeros(0)
    sizes = distributed.all_gather_tensor(torch.tensor([mine.numel()]), group)
    longest = max(int(n) for n in sizes)
    padded = torch.cat([mine, mine.new_zeros(longest - mine.numel())])
    gathered = distributed.all_gather_tensor(padded, group)
    values = torch.cat([g[: int(n)] for g, n in zip(gathered, sizes)])
    if values.numel() == 0:
        return [None if m is None else torch.zeros_like(m, dtype=torch.bool) for m in masks], 0.0
    threshold = float(_quantile(values, 1 - quantile))
    out: list[torch.Tensor | None] = []
    for m, h in zip(masks, entropies):
        out.append(None if m is None or h is None else m.bool() & (h.detach().float() >= threshold))
    return out, float((values < threshold).sum()) / values.numel()


def _quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile's linear interpolation, also past its input-size limit (2^24 elements)."""
    if values.numel() < 2**24:
        return torch.quantile(values, q)
    ordered = values.sort().values
    pos = q * (values.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, values.numel() - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def placeholder_batch(trajectories: Sequence[Trajectory], backend: Trainable) -> TrainingBatch:
    """One sample standing in for an empty micro-batch, so collectives stay aligned (its loss is
    scaled by 0, its values go unused)."""
    first = next((t for t in trajectories if t.num_trained_tokens > 0), None)
    first = first or Trajectory(token_ids=[0, 0], loss_mask=[0, 1], rollout_logprobs=None)
    return build_batch([first], [0.0], layout=backend.layout, pad_to_multiple=backend.pad_to_multiple)


def reduce_metrics(sums: Mapping[str, torch.Tensor] | None, group: ProcessGroup | None) -> dict[str, float]:
    """Sum (max for '/max', min for '/min') the loss metric sums over `group`, then finalize."""
    if sums is None:  # this rank had nothing; its neutral values still join the reductions
        sums = empty_metrics()
    merged: dict[str, float] = {}
    # the same key set on every rank, whatever its config, so every rank makes the same calls
    for op, mine in keys_by_reduction(sums).items():
        if not mine:
            continue
        values = torch.stack([sums[k].double() for k in mine])
        distributed.all_reduce(values, op, group)
        merged.update(zip(mine, values.tolist()))
    return finalize_metrics(merged)
