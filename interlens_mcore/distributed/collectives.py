"""Collective helpers, and the stages and local phases that keep every rank in the same one.

Every collective helper takes `group=None` (the default world group) and is a no-op when the
group has one rank or torch.distributed is not initialised.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


# --- stages and local phases ------------------------------------------------------------------
#
# The rule that keeps every rank in the same collective (docs/parallelism.md, "Failing
# together"): user code (task sources, environments, tools, schedulers, reward functions) runs
# only inside a *local phase*, and a local phase ends at the world check (`check_world`), which
# every rank reaches whatever that code did. Collectives over the world or the DP group come
# after the check, never inside the phase: a rank whose code raised is already waiting in the
# check, and a peer entering any other collective would wait for it until the timeout.
# Inside a local phase the only collectives allowed are the rollout's own, over the groups the
# phase names: each of them follows the rollout's vote, which carries every rank's error. Any
# other collective there raises `CollectiveInLocalPhase` at once on the rank that attempts it
# (bookkeeping in this process, no communication), so the mistake fails named the first time it
# runs instead of hanging the first time some user code raises.


class CollectiveInLocalPhase(RuntimeError):
    """A collective over a group that a local phase does not allow (a bug in the caller)."""


class CollectiveError(RuntimeError):
    """A collective failed (its timeout expired, or a peer left): names it, its ranks and the stage."""


@dataclass(frozen=True)
class _Stage:
    name: str
    allow: tuple[ProcessGroup | None, ...] | None  # a local phase's allowed groups; None for a plain stage


class _Stages(threading.local):
    def __init__(self) -> None:  # runs once in each thread that uses it
        self.stack: list[_Stage] = []


_stages = _Stages()


def _stack() -> list[_Stage]:
    return _stages.stack


def current_stage() -> str | None:
    """What this rank is doing, as the nested stage names ("step 3 / rollout"), or None."""
    names = [s.name for s in _stack()]
    return " / ".join(names) if names else None


@contextmanager
def stage(name: str, *, allow: tuple[ProcessGroup | None, ...] | None = None) -> Iterator[None]:
    """Name what this rank is doing: collectives that fail inside say so, and so does an
    exception leaving it (as a note, once, with the innermost stage).

    `allow` makes it a local phase (see above): collectives inside are refused unless their
    group is one of `allow` (the rollout's own groups; `()` allows none).
    """
    stack = _stack()
    stack.append(_Stage(name, allow))
    try:
        yield
    except BaseException as exc:
        notes = getattr(exc, "__notes__", [])  # an exception carries no notes until one is added
        if not any(n.startswith("during stage ") for n in notes):
            exc.add_note(f"during stage {current_stage()!r}")
        raise
    finally:
        stack.pop()


def local_phase(name: str, allow: tuple[ProcessGroup | None, ...] = ()) -> AbstractContextManager[None]:
    """`stage(name, allow=allow)`: a block of user code that ends at a world check."""
    return stage(name, allow=tuple(g for g in allow if g is not None))


@contextmanager
def _collective(name: str, group: ProcessGroup | None) -> Iterator[None]:
    allowed = [s.allow for s in _stack() if s.allow is not None]  # one per enclosing local phase
    if allowed and not any(group is g for g in allowed[-1]):
        raise CollectiveInLocalPhase(
            f"{name} over ranks {_group_ranks(group)} inside the local phase {current_stage()!r}: "
            "only the rollout's own collectives may run before the world check; move it after "
            "the check (distributed.check_world)"
        )
    try:
        yield
    except RuntimeError as exc:  # gloo's DistBackendError (a timeout, a closed connection) and kin
        if isinstance(exc, (CollectiveError, CollectiveInLocalPhase)):
            raise
        where = current_stage() or "no named stage"
        ranks = _group_ranks(group)
        raise CollectiveError(f"{name} over ranks {ranks} failed during {where!r}: {_describe(exc)}") from exc


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: ProcessGroup | None = None) -> torch.Tensor:
    """In-place all-reduce without autograd ('sum' or 'max'); returns `tensor`."""
    if world_size(group) == 1:
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce op must be one of {sorted(ops)}, got {op!r}")
    with _collective("all_reduce", group):
        dist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def all_gather_object(obj: object, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's `obj`, in group-rank order (unpickled: each caller knows the shape it sent)."""
    if world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * world_size(group)
    with _collective("all_gather_object", group):
        dist.all_gather_object(out, obj, group=group)
    return out


class _SumForwardCopyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def all_reduce_replicated(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum over the group, with an identity backward.

    For partial sums whose result feeds a loss that every rank of the group computes
    identically (vocab-parallel logprobs under TP): each rank then owns the same upstream
    gradient, so summing it again in backward (as torch.distributed.nn's all_reduce does) would scale the
    shard gradients by the group size. Same contract as megatron's
    `reduce_from_tensor_model_parallel_region`, but for any group.
    """
    if world_size(group) == 1:
        return tensor
    with _collective("all_reduce_replicated", group):
        return _SumForwardCopyBackward.apply(tensor, group)


def all_gather_tensor(tensor: torch.Tensor, group: ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on all ranks), in group-rank order; no autograd."""
    if world_size(group) == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(world_size(group))]
    with _collective("all_gather_tensor", group):
        dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def broadcast_tensor(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """In place: group rank `src`'s `tensor` on every rank (same shape and dtype); no autograd."""
    if world_size(group) == 1:
        return tensor
    with _collective("broadcast_tensor", group):
        dist.broadcast(
            tensor, src=dist.get_global_rank(group, src) if group is not None else src, group=group
        )
    return tensor


def barrier(group: ProcessGroup | None = None) -> None:
    if world_size(group) > 1:
        with _collective("barrier", group):
            dist.barrier(group=group)


def barrier_or_gone(group: ProcessGroup | None = None) -> None:
    """A barrier that returns, instead of raising, when a peer has already left (after a failure)."""
    try:
        barrier(group)
    except (RuntimeError, dist.DistBackendError):  # gloo: "Connection closed by peer"
        pass


# --- small objects in one collective (the rollout vote, the world check) ------------------------


_SMALL = 4096  # bytes per rank of the one-collective fast path (a ballot pickles to ~200)


def all_gather_small(obj: T, group: ProcessGroup | None = None) -> list[T]:
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
    with _collective("all_gather_small", group):
        dist.all_gather_into_tensor(out, buf, group=group)
    chunks = out.view(-1, _SMALL)
    sizes = [int.from_bytes(bytes(c[:8].tolist()), "little", signed=True) for c in chunks]
    if min(sizes) < 0:  # somebody's object is large: everyone takes the general path
        return cast(list[T], all_gather_object(obj, group=group))  # every rank sends a T
    # every rank of the group sends a T
    return [pickle.loads(c[8 : 8 + n].numpy().tobytes()) for c, n in zip(chunks, sizes, strict=True)]


def _group_ranks(group: ProcessGroup | None) -> tuple[int, ...]:
    if group is None:
        return tuple(range(world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:500]
