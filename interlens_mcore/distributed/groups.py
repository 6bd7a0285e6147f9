"""Process groups: torch.distributed and megatron-core's parallel_state set up, described once.

`build_groups` hands every other module a frozen `ParallelGroups`; nothing else reads ranks or
parallel_state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..rollout.vote import local_gather
from .collectives import _group_ranks, all_gather_object, all_gather_small, is_initialized, rank, world_size

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def megatron_tp_group() -> ProcessGroup:
    """megatron-core's tensor-parallel group of this rank (parallel_state must be initialised)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(
            "megatron-core parallel_state is not initialised: call "
            "parallel_state.initialize_model_parallel(tensor_model_parallel_size=...) first"
        )
    return parallel_state.get_tensor_model_parallel_group()


@dataclass(frozen=True)
class ParallelGroups:
    """Who this rank works with. Groups are torch ProcessGroups (None: the world / trivial)."""

    rank: int
    world_size: int
    dp: ProcessGroup | None = None
    tp: ProcessGroup | None = None
    pp: ProcessGroup | None = None
    cp: ProcessGroup | None = None
    rollout: ProcessGroup | None = None  # ranks whose collectives sit inside one generation call
    rollout_ranks: tuple[int, ...] = (0,)
    vote: ProcessGroup | None = None  # gloo side group over rollout_ranks, with its own timeout
    tp_size: int = 1
    dp_size: int = 1

    @property
    def rollout_rank(self) -> int:
        return self.rollout_ranks.index(self.rank)

    @property
    def rollout_collectives(self) -> tuple[ProcessGroup | None, ...]:
        """The groups a rollout's own collectives use (each after the vote): a local phase's `allow`."""
        return (self.rollout, self.vote, self.tp)

    def gather_fn(self) -> Callable[[list[object]], list[object]]:
        """The termination vote's gather_fn (accelerate gather_object convention)."""
        if len(self.rollout_ranks) == 1:
            return local_gather
        group = self.vote

        def gather(items: list[object]) -> list[object]:
            return [x for part in all_gather_small(items, group=group) for x in part]

        return gather


def side_groups(group: ProcessGroup | None, *, timeout_s: float) -> ProcessGroup | None:
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
    *,
    rollout: str = "model_parallel",
    vote_timeout_s: float = 1800.0,
    rollout_group: ProcessGroup | None = None,
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


def _single_rank_group() -> ProcessGroup | None:
    # one group per rank, created in the same order everywhere
    out = None
    for r in range(world_size()):
        g = dist.new_group([r], backend="gloo")
        if r == rank():
            out = g
    return out


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
    if restart is None or not _agent_store(os.environ):
        # not under torchrun, or torchrun gives each rendezvous round a fresh store (rank 0 hosts it)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        return
    # Under torchrun every process group's rendezvous keys live in the agent's store, which
    # outlives a restart: a restarted rank would read a dead peer's address for a subgroup
    # (megatron's TP and DP groups) before the live peer rewrites it. A prefix per attempt keeps
    # them apart; it names the same attempt on every rank only while one agent restarts them all.
    check_restartable(os.environ)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store: dist.Store = dist.TCPStore(
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


SHARED_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _agent_store(env: Mapping[str, str]) -> bool:
    """torchrun's workers share its agent's store, kept across rounds (not with SHARED_STORE_OFF=1)."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def check_restartable(env: Mapping[str, str]) -> None:
    """ValueError for a multi-node torchrun that may restart its workers over one shared store.

    torchrun's c10d rendezvous keeps one store for the workers across rounds. After a lost
    worker, its node's agent counts a restart, while an agent that only saw a node waiting does
    not: the ranks' restart counts differ, so no per-attempt key prefix is the same on every
    rank, and without one a restarted rank reads a dead peer's keys; either way the restarted
    ranks would wait for each other until the collective timeout. With `SHARED_STORE_OFF=1`
    every round gets a fresh store (launch/multinode.sh sets it).
    """
    nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    if _agent_store(env) and nodes > 1 and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise ValueError(
            f"torchrun with {nodes} nodes and --max-restarts > 0 shares one rendezvous store across "
            f"restarts, and the restarted ranks would wait for each other; set {SHARED_STORE_OFF}=1 "
            "for every node's torchrun (launch/multinode.sh sets it), or --max-restarts 0"
        )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_megatron(tensor_parallel_size: int, *, pp: int = 1, timeout_s: float = 1800.0) -> None:
    """megatron-core's parallel_state for TP x PP x DP over the world (TP x PP must divide it);
    its groups time out after `timeout_s` (megatron counts whole minutes: rounded up)."""
    from megatron.core import parallel_state as ps

    if world_size() % (tensor_parallel_size * pp):
        raise ValueError(
            f"TP size {tensor_parallel_size} x PP size {pp} does not divide the world size {world_size()}"
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel_size,
            pipeline_model_parallel_size=pp,
            distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
        )


def destroy() -> None:
    """Tear down megatron's parallel_state (if set) and the process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if is_initialized():
        dist.destroy_process_group()


def check_layout(*, tp: int, pp: int = 1, cp: int = 1, world: int | None = None) -> None:
    """ValueError naming the flag for a parallel layout the trainers cannot run.

    Context parallelism is described in docs/parallelism.md and refused until it is built.
    Imports nothing of megatron, so a launcher can call it first.
    """
    world = world_size() if world is None else world
    if cp != 1:
        raise ValueError(
            f"--cp {cp}: context parallelism is not supported yet (docs/parallelism.md says how it "
            "would fit); use --cp 1"
        )
    if tp < 1 or world % tp:
        raise ValueError(f"--tp {tp} does not divide the world size {world}")
    if pp < 1 or world % (tp * pp):
        raise ValueError(f"--tp {tp} x --pp {pp} does not divide the world size {world}")


def launcher_store(*, timeout_s: float = 60.0) -> dist.TCPStore | None:
    """torchrun's own key-value store (it outlives a restart of the workers), or None outside
    torchrun and where torchrun gives every round a fresh store (`SHARED_STORE_OFF`)."""
    import os

    if "TORCHELASTIC_RUN_ID" not in os.environ or not _agent_store(os.environ):
        return None
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        use_libuv=True,
    )
