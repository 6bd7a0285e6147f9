"""The one module that touches torch.distributed and megatron-core's parallel_state.

Every collective helper takes `group=None` (the default world group) and is a no-op when the
group has one rank or torch.distributed is not initialised.
"""

from __future__ import annotations

import math
import pickle
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
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
    allow: tuple[Any, ...] | None  # a local phase's allowed groups; None for a plain stage


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
def stage(name: str, *, allow: tuple[Any, ...] | None = None) -> Iterator[None]:
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


def local_phase(name: str, allow: tuple[Any, ...] = ()) -> Any:
    """`stage(name, allow=allow)`: a block of user code that ends at a world check."""
    return stage(name, allow=tuple(g for g in allow if g is not None))


@contextmanager
def _collective(name: str, group: Any) -> Iterator[None]:
    phases = [s for s in _stack() if s.allow is not None]
    if phases and not any(group is g for g in phases[-1].allow):
        raise CollectiveInLocalPhase(
            f"{name} over ranks {_group_ranks(group)} inside the local phase {current_stage()!r}: "
            "only the rollout's own collectives may run before the world check; move it after "
            "the check (parallel.check_world)"
        )
    try:
        yield
    except RuntimeError as exc:  # gloo's DistBackendError (a timeout, a closed connection) and kin
        if isinstance(exc, (CollectiveError, CollectiveInLocalPhase)):
            raise
        where = current_stage() or "no named stage"
        ranks = _group_ranks(group)
        raise CollectiveError(f"{name} over ranks {ranks} failed during {where!r}: {_describe(exc)}") from exc


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """In-place all-reduce without autograd ('sum' or 'max'); returns `tensor`."""
    if world_size(group) == 1:
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce op must be one of {sorted(ops)}, got {op!r}")
    with _collective("all_reduce", group):
        dist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in group-rank order."""
    if world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * world_size(group)
    with _collective("all_gather_object", group):
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
    with _collective("all_reduce_replicated", group):
        return _SumForwardCopyBackward.apply(tensor, group)


def all_gather_tensor(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on all ranks), in group-rank order; no autograd."""
    if world_size(group) == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(world_size(group))]
    with _collective("all_gather_tensor", group):
        dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def barrier(group: Any = None) -> None:
    if world_size(group) > 1:
        with _collective("barrier", group):
            dist.barrier(group=group)


def barrier_or_gone(group: Any = None) -> None:
    """A barrier that returns, instead of raising, when a peer has already left (after a failure)."""
    try:
        barrier(group)
    except (RuntimeError, dist.DistBackendError):  # gloo: "Connection closed by peer"
        pass


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

    @property
    def rollout_collectives(self) -> tuple[Any, ...]:
        """The groups a rollout's own collectives use (each after the vote): a local phase's `allow`."""
        return (self.rollout, self.vote, self.tp)

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
    with _collective("all_gather_small", group):
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
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        return
    # Under torchrun every process group's rendezvous keys live in one store that outlives a
    # restart: a restarted rank would read a dead peer's address for a subgroup (megatron's TP
    # and DP groups) before the live peer rewrites it. A prefix per attempt keeps them apart.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        use_libuv=True,
    )
    store = dist.PrefixStore(f"interlens/attempt_{restart}", store)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_megatron(tensor_parallel_size: int, *, timeout_s: float = 1800.0) -> None:
    """megatron-core's parallel_state for TP x DP over the world (TP must divide it); its groups
    time out after `timeout_s` (megatron counts whole minutes: rounded up)."""
    from megatron.core import parallel_state as ps

    if world_size() % tensor_parallel_size:
        raise ValueError(f"TP size {tensor_parallel_size} does not divide the world size {world_size()}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel_size,
            distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
        )


def destroy() -> None:
    """Tear down megatron's parallel_state (if set) and the process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if is_initialized():
        dist.destroy_process_group()


# --- failing together -----------------------------------------------------------------------


class WorldFailure(RuntimeError):
    """A rank of the world failed (or left); raised on every rank with the same message.

    `failures` holds (global rank, "ExceptionType: message") of every rank that reported an
    error; it is empty when a peer disappeared without reporting (killed, or out of memory).
    """

    def __init__(self, failures: list[tuple[int, str]], *, lost: str | None = None) -> None:
        self.failures, self.lost = failures, lost
        if failures:
            rank_, cause = failures[0]
            rest = [str(r) for r, _ in failures[1:]]
            plural = "s" if len(rest) > 1 else ""
            others = f" (rank{plural} {', '.join(rest)} failed too)" if rest else ""
            message = f"rank {rank_} failed: {cause}{others}"
        else:
            message = f"a rank left the world before reporting ({lost})"
        super().__init__(message)


def world_check_group(*, timeout_s: float) -> Any:
    """A gloo group over the whole world with its own timeout, for `check_world` (collective).

    The timeout must exceed the longest gap between two ranks reaching the check (a rank that
    failed early waits there while the others finish their rollouts).
    """
    if not is_initialized():
        return None
    return dist.new_group(list(range(world_size())), backend="gloo", timeout=timedelta(seconds=timeout_s))


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:500]


def check_world(error: BaseException | None, group: Any = None) -> None:
    """Fail together: every rank calls this at the same point, with its own error or None.

    When any rank passes an error, every rank raises the same `WorldFailure` naming the first
    failing rank and its cause (chained to the local error, if any). A peer that vanished
    (SIGKILL) makes the gloo collective fail at once; that too becomes a `WorldFailure`, so the
    last line every rank prints is a named cause, not a transport error. `group` is a gloo
    group (`world_check_group`): never NCCL, whose watchdog would abort the process instead.
    """
    mine = None if error is None else _describe(error)
    if world_size(group) > 1 and dist.get_backend(group) != "gloo":
        raise ValueError("check_world needs a gloo group (parallel.world_check_group), not the NCCL world")
    if world_size(group) == 1:
        if mine is not None:
            raise WorldFailure([(rank(), mine)]) from error
        return
    try:
        reports = all_gather_small(mine, group=group)
    except RuntimeError as exc:  # gloo's DistBackendError and friends: the peer is gone
        raise WorldFailure([(rank(), mine)] if mine else [], lost=_describe(exc)) from error or exc
    failures = [(r, d) for r, d in zip(_group_ranks(group), reports, strict=True) if d is not None]
    if failures:
        raise WorldFailure(failures) from error


# --- sharded checkpoints (torch.distributed.checkpoint) ---------------------------------------


@dataclass(frozen=True)
class Block:
    """One rank's block of a tensor that is split over a group, as a checkpoint stores it.

    `local` is this rank's tensor (saved from, or loaded into, in place); `offsets[i]` and
    `shapes[i]` place group rank i's block inside `global_shape`. Blocks need not be equal
    (a vocabulary cut at its true size leaves the last one shorter).
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, ...], ...]


def _sharded_tensor(block: Block, group: Any) -> Any:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    owners = _group_ranks(group)
    mine = owners.index(rank())
    if tuple(block.local.shape) != block.shapes[mine]:
        raise ValueError(f"block shape {tuple(block.local.shape)} != declared {block.shapes[mine]}")
    device = block.local.device.type
    meta = [
        ShardMetadata(list(o), list(s), f"rank:{r}/{device}")
        for o, s, r in zip(block.offsets, block.shapes, owners, strict=True)
    ]
    props = TensorProperties(dtype=block.local.dtype, layout=block.local.layout, requires_grad=False)
    st_meta = ShardedTensorMetadata(
        shards_metadata=meta, size=torch.Size(block.global_shape), tensor_properties=props
    )
    local = [Shard.from_tensor_and_offsets(block.local, list(block.offsets[mine]), rank())]
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, sharded_tensor_metadata=st_meta)


def _dcp_state(blocks: dict[str, Block], plain: dict[str, Any], group: Any) -> dict[str, Any]:
    if not is_initialized():
        raise ValueError("sharded checkpoints need torch.distributed (call parallel.init_distributed())")
    return {**plain, **{k: _sharded_tensor(b, group) for k, b in blocks.items()}}


@contextmanager
def _quiet_sharded_tensor():
    # torch warns that ShardedTensor is deprecated in favour of DTensor on every use; DTensor
    # needs a device mesh of the whole TP x DP grid, while these blocks need only the TP group
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*DTensor instead.*ShardedTensor", category=FutureWarning)
        yield


def save_sharded(
    folder: str | Path, blocks: dict[str, Block], plain: dict[str, Any], group: Any = None
) -> None:
    """Write `blocks` (split over `group`) and `plain` (the same on every rank) with
    torch.distributed.checkpoint; collective over the world.

    Replicas (the same block on several DP ranks, a plain tensor on every rank) are written
    once: the planner keeps one copy of each (key, offset).
    """
    import torch.distributed.checkpoint as dcp

    with _quiet_sharded_tensor():
        dcp.save(_dcp_state(blocks, plain, group), checkpoint_id=str(folder))


def saved_shapes(folder: str | Path) -> dict[str, tuple[int, ...] | None]:
    """Global shape of every tensor in a sharded checkpoint (None for a non-tensor entry)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {k: tuple(m.size) if isinstance(m, TensorStorageMetadata) else None for k, m in metadata.items()}


def load_sharded(
    folder: str | Path, blocks: dict[str, Block], plain: dict[str, Any], group: Any = None
) -> dict[str, Any]:
    """Read `blocks` in place from a checkpoint written at any split; collective over the world.

    Each rank reads the parts of the saved blocks that overlap its own, so a checkpoint
    written at TP=2 loads at TP=1 and vice versa. Plain tensors are filled in place; plain
    objects come back in the returned dict.
    """
    import torch.distributed.checkpoint as dcp

    with _quiet_sharded_tensor():
        state = _dcp_state(blocks, plain, group)
        dcp.load(state, checkpoint_id=str(folder))
    return {k: state[k] for k in plain}


def check_layout(*, tp: int, pp: int = 1, cp: int = 1, world: int | None = None) -> None:
    """ValueError naming the flag for a parallel layout the trainers cannot run yet.

    Pipeline and context parallelism are described in docs/parallelism.md and refused until
    they are tested. Imports nothing of megatron, so a launcher can call it first.
    """
    world = world_size() if world is None else world
    if pp != 1:
        raise ValueError(
            f"--pp {pp}: pipeline parallelism is not supported yet (docs/parallelism.md says how it "
            "would fit); use --pp 1"
        )
    if cp != 1:
        raise ValueError(
            f"--cp {cp}: context parallelism is not supported yet (docs/parallelism.md says how it "
            "would fit); use --cp 1"
        )
    if tp < 1 or world % tp:
        raise ValueError(f"--tp {tp} does not divide the world size {world}")
