"""The KL to the reference in the reward, with a fixed or adaptive coefficient: `--kl-in-reward`.

The other place for the KL (verl `use_kl_in_reward` with `algorithm.kl_ctrl`, ms-swift
`kl_in_reward`): instead of a loss term, each sample's reward is lowered by beta times its KL
before the advantages are computed, so the KL competes with the task's reward inside the
baseline. One step, after its rollout's world check and dynamic sampling:

    kl_i   = sum over sample i's trained tokens of the --kl-estimator estimate of
             KL(policy || reference), the policy being the weights that generated the step
    r'_i   = r_i - beta * kl_i            advantages from r' (the logged rewards stay r)
    beta  <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon)     (adaptive only)

where kl is the mean over the world's samples of each one's per-token mean KL and n the
world's samples: the proportional controller of Ziegler et al. (2019), as verl's
`AdaptiveKLController`. The coefficient a step used is logged (`kl_in_reward/coef`) with kl
(`kl_in_reward/kl`); the adapted one is saved in the checkpoint, so a resumed run continues it.
`--beta` is the coefficient's start and the loss then has no KL term (one KL, in one place).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from interlens_mcore import distributed
from interlens_mcore.grpo.batch import TrainingBatch, build_batch
from interlens_mcore.grpo.loss.kl import kl_penalty
from interlens_mcore.rollout.rollouter import Rollout, RolloutConfig, rollout_estimate, whole_batch_advantages
from interlens_mcore.types import Trajectory

from .config import KL_HORIZON, KL_TARGET, KLControl
from .update import Trainable, placeholder_batch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_ERROR_CLIP = 0.2  # the controller's bound on kl / target - 1 per update


@dataclass
class KLController:
    """The reward's KL coefficient: fixed, or adapted toward `target` nats per token."""

    value: float
    kind: KLControl = "fixed"
    target: float = KL_TARGET
    horizon: int = KL_HORIZON

    def update(self, kl: float, samples: int) -> None:
        """After a step whose samples had mean per-token KL `kl`, `samples` of them in the world."""
        if self.kind == "fixed" or not math.isfinite(kl):
            return
        error = min(max(kl / self.target - 1.0, -_ERROR_CLIP), _ERROR_CLIP)
        self.value *= 1.0 + error * samples / self.horizon


@dataclass(frozen=True)
class SampleKL:
    """Per sample of a rollout: the KL summed over its trained tokens, and how many it has."""

    total: torch.Tensor  # [N] float64; 0 for a sample with no trained token
    tokens: torch.Tensor  # [N] float64: the trained tokens with finite logprobs on both sides


def sample_kl(
    backend: Trainable,
    trajectories: Sequence[Trajectory],
    *,
    micro_batch_size: int,
    pad_id: int,
    estimator: str,
    clamp: float,
    output_clamp: float | None = None,
) -> SampleKL:
    """Each trajectory's KL to the reference (no gradient); collective through the backend.

    Every rank makes the same number of forwards (ceil(N / micro_batch_size), a placeholder
    where a chunk has no trained token), as the update does: a sharded backend gathers its
    weights in each one."""
    n = len(trajectories)
    total = torch.zeros(n, dtype=torch.float64)
    tokens = torch.zeros(n, dtype=torch.float64)
    size = micro_batch_size or max(1, n)
    chunks = [list(range(n))[i : i + size] for i in range(0, n, size)]
    placeholder = placeholder_batch(trajectories, backend)
    for chunk in chunks:
        used = [i for i in chunk if trajectories[i].num_trained_tokens > 0]
        batch = (
            build_batch(
                [trajectories[i] for i in used],
                [0.0] * len(used),
                layout=backend.layout,
                pad_to_multiple=backend.pad_to_multiple,
                pad_id=pad_id,
            )
            if used
            else placeholder
        )
        with torch.no_grad():
            policy = backend.logprobs_of(batch).detach()
            reference = backend.logprobs_of(batch, reference=True).detach()
        if not used:
            continue
        sums, counts = per_sample_kl(
            batch, policy, reference, estimator=estimator, clamp=clamp, output_clamp=output_clamp
        )
        index = torch.tensor(used)
        total[index], tokens[index] = sums, counts
    return SampleKL(total=total, tokens=tokens)


def own_part(kl: SampleKL, mine: int, group: ProcessGroup | None) -> SampleKL:
    """This rank's `mine` samples of `kl`, computed on the union of `group`'s samples in rank
    order (collective over `group`)."""
    sizes = distributed.all_gather_object(mine, group=group)
    start = sum(sizes[: torch.distributed.get_rank(group)])
    return SampleKL(total=kl.total[start : start + mine], tokens=kl.tokens[start : start + mine])


def per_sample_kl(
    batch: TrainingBatch,
    policy: torch.Tensor,
    reference: torch.Tensor,
    *,
    estimator: str,
    clamp: float,
    output_clamp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] KL summed over each sample's trained tokens, [N] those tokens), float64; a token whose
    logprob is not finite on either side counts for neither."""
    finite = torch.isfinite(policy) & torch.isfinite(reference)
    keep = batch.loss_mask & finite & (batch.sample_ids >= 0)
    zero = torch.zeros_like(policy)
    clean = torch.where(finite, policy, zero), torch.where(finite, reference, zero)
    per_token = kl_penalty(*clean, estimator, clamp, output_clamp)
    n = batch.num_samples
    owner = batch.sample_ids[keep]
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, owner, per_token[keep].double())
    counts = torch.zeros(n, dtype=torch.float64).index_add_(
        0, owner, torch.ones_like(owner, dtype=torch.float64)
    )
    return sums, counts


def mean_token_kl(kl: SampleKL) -> tuple[float, float]:
    """(sum over samples with a trained token of their per-token mean KL, their count): the
    controller's kl is the world's sum over the world's count."""
    has = kl.tokens > 0
    means = kl.total[has] / kl.tokens[has]
    return float(means.sum()), float(has.sum())


@contextlib.contextmanager
def penalized(trajectories: Sequence[Trajectory], penalties: torch.Tensor) -> Iterator[None]:
    """Within the block every scored trajectory's reward is lowered by its penalty; the rewards
    are back as they were afterwards (they are what the step logs)."""
    before = [t.reward for t in trajectories]
    try:
        for t, p in zip(trajectories, penalties.tolist(), strict=True):
            if t.reward is not None:
                t.reward = float(t.reward) - p
        yield
    finally:
        for t, r in zip(trajectories, before, strict=True):
            t.reward = r


def penalized_advantages(
    rollout: Rollout,
    penalties: torch.Tensor,
    config: RolloutConfig,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """The rollout's advantages estimated again from its rewards lowered by `penalties` [N], then
    the whole-batch step (collective, as `whole_batch_advantages`); a sample the raw rewards left
    out stays out (verl filters groups on the scores too)."""
    assert rollout.keep is not None, "the rollout is scored"
    with penalized(rollout.trajectories, penalties):
        est = rollout_estimate(rollout.trajectories, config)
        keep = rollout.keep & est.keep
        rollout.advantages = torch.where(keep, est.advantages, torch.zeros_like(est.advantages))
        rollout.keep, rollout.batch_step = keep, est.batch
        whole_batch_advantages(rollout, reduce_sum)
