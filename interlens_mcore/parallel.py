"""The one module that touches torch.distributed and megatron-core's parallel_state.

Every collective helper takes `group=None` (the default world group) and is a no-op when the
group has one rank or torch.distributed is not initialised.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .vote import local_gather


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


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in group-rank order."""
    if world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


class _SumForwardCopyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def all_reduce_replicated(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum over the group, with an identity backward.

    For partial sums whose result feeds a loss that every rank of the group computes
    identically (vocab-parallel logprobs under TP): each rank then owns the same upstream
    gradient, so summing it again in backward (as torch.distributed.nn's all_reduce does) would scale the
    shard gradients by the group size. Same contract as megatron's
    `reduce_from_tensor_model_parallel_region`, but for any group.
    """
    if world_size(group) == 1:
        return tensor
    return _SumForwardCopyBackward.apply(tensor, group)


def all_gather_tensor(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on all ranks), in group-rank order; no autograd."""
    if world_size(group) == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def barrier(group: Any = None) -> None:
    if world_size(group) > 1:
        dist.barrier(group=group)


def megatron_tp_group() -> Any:
    """megatron-core's tensor-parallel group of this rank (parallel_state must be initialised)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(
            "megatron-core parallel_state is not initialised: call "
            "parallel_state.initialize_model_parallel(tensor_model_parallel_size=...) first"
        )
    return parallel_state.get_tensor_model_parallel_group()


# --- process groups and the rollout vote ------------------------------------------------------


@dataclass(frozen=True)
class ParallelGroups:
    """Who this rank works with. Groups are torch ProcessGroups (None: the world / trivial)."""

    rank: int
    world_size: int
    dp: Any = None
    tp: Any = None
    pp: Any = None
    cp: Any = None
    rollout: Any = None  # ranks whose collectives sit inside one generation call
    rollout_ranks: tuple[int, ...] = (0,)
    vote: Any = None  # gloo side group over rollout_ranks, with its own timeout
    tp_size: int = 1
    dp_size: int = 1

    @property
    def rollout_rank(self) -> int:
        return self.rollout_ranks.index(self.rank)

    def gather_fn(self):
        """The termination vote's gather_fn (accelerate gather_object convention)."""
        if len(self.rollout_ranks) == 1:
            return local_gather
        group = self.vote

        def gather(items: list[Any]) -> list[Any]:
            return [x for part in all_gather_small(items, group=group) for x in part]

        return gather


_SMALL = 4096  # bytes per rank of the one-collective fast path (a ballot pickles to ~200)


def all_gather_small(obj: Any, group: Any = None) -> list[Any]:
    """`all_gather_object` in one fixed-size collective when every rank's pickle is small.

    all_gather_object needs two collectives (sizes, then data); the vote runs before every
    round, so it uses one gather of a fixed buffer instead. A rank whose object does not fit
    says so in its header; every rank sees that header and all fall back together.
    """
    if world_size(group) == 1:
        return [obj]
    data = pickle.dumps(obj)
    buf = torch.zeros(_SMALL, dtype=torch.uint8)
    fits = len(data) <= _SMALL - 8
    buf[:8] = torch.tensor(list((len(data) if fits else -1).to_bytes(8, "little", signed=True)))
    if fits:
        buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(world_size(group) * _SMALL, dtype=torch.uint8)
    dist.all_gather_into_tensor(out, buf, group=group)
    chunks = out.view(-1, _SMALL)
    sizes = [int.from_bytes(bytes(c[:8].tolist()), "little", signed=True) for c in chunks]
    if min(sizes) < 0:  # somebody's object is large: everyone takes the general path
        return all_gather_object(obj, group=group)
    return [pickle.loads(c[8 : 8 + n].numpy().tobytes()) for c, n in zip(chunks, sizes, strict=True)]


def _group_ranks(group: Any) -> tuple[int, ...]:
    if group is None:
        return tuple(range(world_size()))
    return tuple(dist.get_process_group_ranks(group))


def side_groups(group: Any, *, timeout_s: float) -> Any:
    """A gloo group over the same ranks as `group` (this rank's one), with its own timeout.

    Collective over the whole world: every rank announces its group, and all distinct groups
    are created in the same order everywhere (torch requires every rank to call new_group).
    The vote rides gloo, never NCCL, so a long rollout cannot trip the NCCL watchdog.
    """
    if not is_initialized():
        return None
    mine = _group_ranks(group)
    every = sorted(set(all_gather_object(mine)))
    out = None
    for ranks in every:
        g = dist.new_group(list(ranks), backend="gloo", timeout=timedelta(seconds=timeout_s))
        if ranks == mine:
            out = g
    return out


def build_groups(
    *, rollout: str = "model_parallel", vote_timeout_s: float = 1800.0, rollout_group: Any = None
) -> ParallelGroups:
    """Describe this rank's groups, from megatron's parallel_state when it is initialised.

    rollout: "model_parallel" (generation with the Megatron model: the TP x PP x CP ranks of
    one DP index), "data_parallel" (an HF model under ZeRO-3: every forward gathers weights
    across the DP group), or "world". `rollout_group` overrides it with the caller's group.
    Collective: every rank of the world must call it.
    """
    if not is_initialized():
        return ParallelGroups(rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    r, w = rank(), world_size()
    if ps.model_parallel_is_initialized():
        dp, tp = ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group()
        pp, cp = ps.get_pipeline_model_parallel_group(), ps.get_context_parallel_group()
        mp = ps.get_model_parallel_group()  # TP x PP of one DP index
        tp_size, dp_size = ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()
    else:
        # plain torch.distributed: every rank is one data-parallel replica
        dp, tp, pp, cp, mp, tp_size, dp_size = dist.group.WORLD, None, None, None, None, 1, w
    choices = {"model_parallel": mp, "data_parallel": dp, "world": dist.group.WORLD}
    if rollout_group is None and rollout not in choices:
        raise ValueError(f"build_groups: rollout must be one of {sorted(choices)}, got {rollout!r}")
    group = rollout_group if rollout_group is not None else choices[rollout]
    if rollout == "model_parallel" and rollout_group is None and mp is None:
        group = _single_rank_group()
    vote = side_groups(group, timeout_s=vote_timeout_s)
    return ParallelGroups(
        rank=r,
        world_size=w,
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        rollout=group,
        rollout_ranks=_group_ranks(group),
        vote=vote,
        tp_size=tp_size,
        dp_size=dp_size,
    )


def _single_rank_group() -> Any:
    # one group per rank, created in the same order everywhere
    out = None
    for r in range(world_size()):
        g = dist.new_group([r], backend="gloo")
        if r == rank():
            out = g
    return out


# --- process-group set-up for the trainers (appended for trainers/) ---------------------------


def init_distributed(*, timeout_s: float = 1800.0) -> None:
    """Initialise torch.distributed from torchrun's environment (gloo on CPU, NCCL on GPU).

    A plain `python` run (no RANK in the environment) becomes a one-rank gloo world, so the
    trainers take one code path.
    """
    import os

    if is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_megatron(tensor_parallel_size: int) -> None:
    """megatron-core's parallel_state for TP x DP over the world (TP must divide it)."""
    from megatron.core import parallel_state as ps

    if world_size() % tensor_parallel_size:
        raise ValueError(f"TP size {tensor_parallel_size} does not divide the world size {world_size()}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)


def destroy() -> None:
    """Tear down megatron's parallel_state (if set) and the process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if is_initialized():
        dist.destroy_process_group()
