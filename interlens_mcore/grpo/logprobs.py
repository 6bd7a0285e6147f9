"""Per-token logprobs of the targets from logits, full-vocabulary or vocab-distributed.

Both divide the logits by the sampling temperature first, so the trainer scores a token under
the same distribution the engine sampled it from (rollout logprobs are temperature-scaled).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from interlens_mcore import distributed

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def _check(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits must be [..., V] with leading dims equal to targets {tuple(targets.shape)}, "
            f"got {tuple(logits.shape)}"
        )
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] over the full vocabulary.

    logits [..., V], targets [...] (every id in [0, V)); returns float32 [...], differentiable.
    """
    _check(logits, targets, temperature)
    vocab = logits.shape[-1]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(f"targets must lie in [0, {vocab}), got ids outside it")
    x = logits.float() / temperature  # [..., V] float32: bf16 logsumexp loses the small logprobs
    picked = torch.gather(x, -1, targets.long().unsqueeze(-1)).squeeze(-1)  # [...]
    return picked - torch.logsumexp(x, dim=-1)


def vocab_parallel_token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    temperature: float = 1.0,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Logprobs of `targets` from this rank's vocabulary shard, without gathering the vocabulary.

    logits [..., V_shard] hold the columns [vocab_start, vocab_start + V_shard) of the full
    vocabulary; targets [...] are full-vocabulary ids in [0, V), identical on every rank of
    `group` (the TP group), V being the sum of the shard widths (one scalar all-reduce). Three
    small all-reduces over [...] replace the [..., V] gather: the max (for a stable exp), the
    sum of exps, and the target's logit (owned by exactly one rank). Returns
    float32 [...], the same on every rank, equal to megatron's
    `-vocab_parallel_cross_entropy(logits / temperature, targets)`. Gradients reach only the
    local shard, with megatron's convention that the loss downstream is replicated over the
    group (backward of the sums is the identity).
    """
    _check(logits, targets, temperature)
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    x = logits.float() / temperature  # [..., V_shard]
    shard = x.shape[-1]
    # The full vocabulary is the union of the shards. Every rank holds the same targets and
    # gets the same size back, so every rank raises together and no collective is left waiting.
    width = torch.tensor([shard], dtype=torch.int64, device=x.device)
    vocab = int(distributed.all_reduce(width, "sum", group).item())
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise ValueError(
            f"targets must lie in [0, {vocab}) (the vocabulary of the {shard}-column shards), "
            f"got ids in [{int(targets.min())}, {int(targets.max())}]"
        )
    # The max is only a shift for a stable exp; logsumexp does not depend on it, so no gradient.
    shift = x.detach().amax(dim=-1)  # [...]
    distributed.all_reduce(shift, "max", group)
    sum_exp = torch.exp(x - shift.unsqueeze(-1)).sum(dim=-1)  # [...]
    sum_exp = distributed.all_reduce_replicated(sum_exp, group)

    local = targets.long() - vocab_start  # [...]
    owned = (local >= 0) & (local < shard)
    # Clamp so the gather is in range on ranks that do not own the target; `where` (not a
    # multiplication) then drops that value, so a non-finite logit elsewhere cannot leak in.
    picked = torch.gather(x, -1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)  # [...]
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    picked = distributed.all_reduce_replicated(picked, group)
    return picked - shift - torch.log(sum_exp)


def token_entropy(logits: torch.Tensor, *, temperature: float = 1.0, grad: bool = False) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at each position, in nats; float32 [...].

    logits [..., V]: the distribution the engine sampled from (the same scaling as
    `token_logprobs`), so its entropy is the policy's at sampling time. grad: differentiable
    (for an entropy bonus); otherwise computed without gradient."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if grad:
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        p = logp.exp()
        # a column of probability 0 adds 0 (and no NaN gradient from -inf * 0)
        return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(dim=-1)
    with torch.no_grad():
        x = logits.detach().float() / temperature
        logp = torch.log_softmax(x, dim=-1)
        p = logp.exp()  # a column of probability 0 adds 0, not 0 * -inf
        return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)


def vocab_parallel_token_entropy(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    group: ProcessGroup | None = None,
    grad: bool = False,
) -> torch.Tensor:
    """`token_entropy` from this rank's vocabulary shard (logits [..., V_shard]), the same on every
    rank of `group`: H = log Z - E_p[x] with x = logits / temperature, from three all-reduces over
    [...] (the max, the sum of exps, the sum of exp-weighted logits).

    grad: differentiable, with `vocab_parallel_token_logprobs`'s convention (the sums' backward
    is the identity, the loss downstream being replicated over the group): each rank's shard
    gets its slice of the full-vocabulary gradient -p (x - E_p[x]) / temperature."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if grad:
        x = logits.float() / temperature
        # the shift cancels in H, so it carries no gradient
        shift = x.detach().amax(dim=-1)
        distributed.all_reduce(shift, "max", group)
        e = torch.exp(x - shift.unsqueeze(-1))
        ex = e * torch.where(e > 0, x, torch.zeros_like(x))  # a -inf logit adds 0
        sums = distributed.all_reduce_replicated(torch.stack([e.sum(dim=-1), ex.sum(dim=-1)]), group)
        return shift + torch.log(sums[0]) - sums[1] / sums[0]
    with torch.no_grad():
        x = logits.detach().float() / temperature
        shift = x.amax(dim=-1)
        distributed.all_reduce(shift, "max", group)
        e = torch.exp(x - shift.unsqueeze(-1))
        # a column whose logit is -inf has e = 0: its term is 0, not 0 * -inf
        ex = torch.where(e > 0, e * x, torch.zeros_like(x))
        sums = torch.stack([e.sum(dim=-1), ex.sum(dim=-1)])  # [2, ...]
        distributed.all_reduce(sums, "sum", group)
        return shift + torch.log(sums[0]) - sums[1] / sums[0]
