"""The optimizer updates of one step: micro-batches through the loss, backward, one guarded step.

Collective over the DP group (denominators, metrics) and, through the backend, over TP: every
rank makes the same number of forward/backward calls, a rank without rows joining with a
zero-weighted placeholder batch so the gradient all-reduce stays aligned.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from interlens_mcore import parallel
from interlens_mcore.batch import TrainingBatch, build_batch
from interlens_mcore.loss import LossConfig, batch_loss, finalize_metrics, merge_metrics
from interlens_mcore.rollout import Rollout
from interlens_mcore.trajectory import Trajectory

# reductions over the DP group by key suffix; every other metric is a sum
_REDUCE = {"/max": "max", "/min": "min"}


def update(trainer: Any, batches: list[TrainingBatch | None], rollout: Rollout) -> dict[str, float]:
    """`updates_per_rollout` optimizer steps on `batches`; returns the finalized metrics."""
    backend, groups = trainer.backend, trainer.groups
    placeholder = _placeholder(rollout, backend)
    counts = torch.tensor(
        [sum(b.num_loss_tokens for b in batches if b), sum(b.num_samples for b in batches if b)],
        dtype=torch.float64,
    )
    # global denominators: the loss of every micro-batch on every DP rank sums to the mean
    num_tokens, num_sequences = parallel.all_reduce(counts, group=groups.dp).tolist()
    if num_tokens == 0:  # nothing trainable anywhere (e.g. every group dropped)
        return {"grad_norm": 0.0, "skipped": 1.0, "step_skipped": 0.0}
    old = None
    if trainer.config.updates_per_rollout > 1:
        with torch.no_grad():
            old = [backend.logprobs_of(b).detach() if b else None for b in batches]
    beta = trainer.loss_config.beta
    refs = [backend.logprobs_of(b, reference=True) if b and beta > 0 else None for b in batches]
    skipped, sums, grad_norm = 0, None, 0.0
    for _ in range(trainer.config.updates_per_rollout):
        sums = None
        for i, batch in enumerate(batches):
            real = batch is not None
            mb = batch if real else placeholder
            lp = backend.logprobs_of(mb)
            kwargs = {
                "old_logprobs": old[i] if old and real else None,
                "ref_logprobs": refs[i] if real else None,
            }
            if not real and beta > 0:
                kwargs["ref_logprobs"] = lp.detach()
            loss, metrics = trainer.loss_fn(
                lp, mb, trainer.loss_config, num_tokens=num_tokens, num_sequences=num_sequences, **kwargs
            )
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
    trainer.skipped_steps += skipped
    metrics = reduce_metrics(sums, groups.dp, trainer.loss_config)
    return {**metrics, "grad_norm": grad_norm, "step_skipped": float(skipped > 0)}


def _placeholder(rollout: Rollout, backend: Any) -> TrainingBatch:
    # stands in for an empty micro-batch so collectives stay aligned; its loss is scaled by 0
    first = next((t for t in rollout.trajectories if t.num_trained_tokens > 0), None)
    first = first or Trajectory(token_ids=[0, 0], loss_mask=[0, 1], rollout_logprobs=None)
    return build_batch([first], [0.0], layout=backend.layout, pad_to_multiple=backend.pad_to_multiple)


def reduce_metrics(sums: dict | None, group: Any, config: LossConfig) -> dict[str, float]:
    """Sum (max for '/max', min for '/min') the loss metric sums over `group`, then finalize."""
    if sums is None:  # this rank had nothing; its neutral values still join the reductions
        sums = zero_metrics(config)
    keys = sorted(sums)
    merged: dict[str, float] = {}
    for op in ("sum", "max", "min"):
        mine = [k for k in keys if _REDUCE.get("/" + k.rsplit("/", 1)[-1], "sum") == op]
        if not mine:
            continue
        values = torch.stack([sums[k].double() for k in mine])
        parallel.all_reduce(values, op, group)
        merged.update(zip(mine, values.tolist()))
    return finalize_metrics(merged)


def zero_metrics(config: LossConfig) -> dict[str, torch.Tensor]:
    """The metric keys of the loss, all at their neutral value (for a rank that trained on nothing).

    Zero for sums; -inf / +inf for max / min keys, so this rank never decides a max or a min.
    """
    t = Trajectory(token_ids=[0, 1], loss_mask=[0, 1], rollout_logprobs=None)
    b = build_batch([t], [0.0])
    # the keys depend on the config (IS and KL modes): the same config as every other rank's
    zeros = torch.zeros(b.input_ids.shape)
    ref = zeros if config.beta > 0 else None
    _, m = batch_loss(zeros, b, config, num_tokens=1, num_sequences=1, ref_logprobs=ref)
    neutral = {"max": -math.inf, "min": math.inf, "sum": 0.0}
    return {k: torch.tensor(neutral[_REDUCE.get("/" + k.rsplit("/", 1)[-1], "sum")]) for k in m}
