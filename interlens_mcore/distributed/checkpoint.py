"""Sharded checkpoint I/O (torch.distributed.checkpoint): blocks split over a group, at any split."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .collectives import _group_ranks, is_initialized, rank

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed._shard.sharded_tensor import ShardedTensor

# what DCP stores besides the blocks: tensors, numbers and strings, the same on every rank
Plain = dict[str, object]


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


def _sharded_tensor(block: Block, group: ProcessGroup | None) -> ShardedTensor:
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


def _dcp_state(blocks: dict[str, Block], plain: Plain, group: ProcessGroup | None) -> dict[str, object]:
    if not is_initialized():
        raise ValueError("sharded checkpoints need torch.distributed (call distributed.init_distributed())")
    return {**plain, **{k: _sharded_tensor(b, group) for k, b in blocks.items()}}


@contextmanager
def _quiet_sharded_tensor():
    # torch warns that ShardedTensor is deprecated in favour of DTensor on every use; DTensor
    # needs a device mesh of the whole TP x DP grid, while these blocks need only the TP group
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*DTensor instead.*ShardedTensor", category=FutureWarning)
        yield


def save_sharded(
    folder: str | Path, blocks: dict[str, Block], plain: Plain, group: ProcessGroup | None = None
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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .safe_load import dcp_metadata

    metadata = dcp_metadata(folder).state_dict_metadata  # DCP's own reader unpickles freely
    return {k: tuple(m.size) if isinstance(m, TensorStorageMetadata) else None for k, m in metadata.items()}


def load_sharded(
    folder: str | Path, blocks: dict[str, Block], plain: Plain, group: ProcessGroup | None = None
) -> Plain:
    """Read `blocks` in place from a checkpoint written at any split; collective over the world.

    Each rank reads the parts of the saved blocks that overlap its own, so a checkpoint
    written at TP=2 loads at TP=1 and vice versa. Plain tensors are filled in place; plain
    objects come back in the returned dict.
    """
    import torch.distributed.checkpoint as dcp

    from .safe_load import dcp_planner, dcp_reader

    with _quiet_sharded_tensor():
        state = _dcp_state(blocks, plain, group)
        # a reader and planner that unpickle nothing but DCP's metadata classes (safe_load)
        dcp.load(state, storage_reader=dcp_reader(folder), planner=dcp_planner())
    return {k: state[k] for k in plain}
