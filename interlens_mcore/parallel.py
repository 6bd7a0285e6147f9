"""The one module that touches torch.distributed and megatron-core's parallel_state.

Every collective helper takes `group=None` (the default world group) and is a no-op when the
group has one rank or torch.distributed is not initialised.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """In-place all-reduce without autograd ('sum' or 'max'); returns `tensor`."""
    if world_size(group) == 1:
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce op must be one of {sorted(ops)}, got {op!r}")
    dist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def all_reduce_autograd(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum over the group whose backward sums the gradients too (used for vocab-parallel math)."""
    if world_size(group) == 1:
        return tensor
    from torch.distributed.nn.functional import all_reduce as _all_reduce

    return _all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in group-rank order."""
    if world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
