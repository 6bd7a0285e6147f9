"""Trained weights as Hugging Face named tensors, for an inference engine that follows training.

A colocated engine (vLLM) loads checkpoint-format tensors: HF names, full (unsharded) shapes.
Each source below yields `(name, tensor)` pairs in that format, straight from memory:

- `hf_tensors(model)`: an HF model held whole on this rank (plain torch, ZeRO-1/2; pass the
  bare module, e.g. `ddp.module`, so names carry no wrapper prefix).
- `megatron_hf_tensors(model, layout)`: a megatron-core GPTModel; TP shards are gathered over
  the TP group and fused QKV / gate-up are split back (`megatron.convert`), so it is collective:
  every rank of the TP group consumes the whole stream. Under pipeline parallelism each stage
  holds its own layers: every stage's tensors are then broadcast over the pipeline group in
  turn, so every rank of the model-parallel group (TP x PP) consumes the whole model's stream.
- `zero3_hf_tensors(model)`: an HF model under DeepSpeed ZeRO-3; each parameter is gathered
  over the data-parallel group in turn (collective, same order on every rank), so at most one
  full parameter is materialised at a time.

A tied model names its output layer only once (`model.embed_tokens.weight`); the engine adds
`lm_head.weight` where its model needs it (`VLLMEngine.update_weights`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SyncReport:
    """One weight update of an engine: the `weight_sync_s` metric and what was moved."""

    seconds: float  # wall time from the first tensor read to the engine holding the new weights
    tensors: int
    bytes: int


def hf_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters of an unsharded HF model, detached (the names its checkpoint uses)."""
    for name, p in model.named_parameters():
        yield name, p.detach()


def megatron_hf_tensors(model: torch.nn.Module, layout) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of a megatron-core GPTModel (the bare model, this rank's TP shard and PP
    stage); collective over the model-parallel group (TP x PP).

    layout: the model's `megatron.ModelLayout`. Every rank of the group gets every full tensor of
    the whole model (vLLM under the trainer's TP then keeps its own slice): a stage's own layers
    gathered over its TP group, the other stages' received from them stage by stage.
    """
    from ..megatron.convert import stage_hf_state_dict
    from ..megatron.stages import pipeline_size

    own = stage_hf_state_dict(model, layout)  # at PP > 1 without a later stage's tied copy
    if pipeline_size() == 1:
        yield from own.items()
        return
    yield from _across_stages(own)


def _across_stages(own: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's `own` tensors on every rank of the pipeline group, stage by stage.

    The names, shapes and dtypes go first (one small gather), then each tensor by a broadcast
    from its stage, yielded as it arrives (a consumer that loads each tensor and drops it holds
    one other stage's tensor at a time)."""
    from megatron.core import parallel_state as ps

    from .. import distributed

    group = ps.get_pipeline_model_parallel_group()
    me = ps.get_pipeline_model_parallel_rank()
    meta = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in own.items()]
    device = torch.device("cuda", torch.cuda.current_device()) if _nccl(group) else torch.device("cpu")
    for stage, names in enumerate(distributed.all_gather_object(meta, group)):
        for name, shape, dtype in names:
            buf = (
                own[name].to(device)
                if stage == me
                else torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            )
            distributed.broadcast_tensor(buf, stage, group)
            yield name, buf.cpu()


def _nccl(group) -> bool:
    import torch.distributed as dist

    return dist.get_backend(group) == "nccl"


def zero3_hf_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of a model whose parameters DeepSpeed ZeRO-3 partitions; collective over DP.

    model: the HF module (`engine.module` of `deepspeed.initialize`). Each parameter is
    gathered, copied to the CPU and released before the next one, so every rank of the group
    must consume the whole stream in order.
    """
    import deepspeed

    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            full = p.detach().to("cpu", copy=True)
        yield name, full


def counted(
    named: Iterable[tuple[str, torch.Tensor]], tally: list[int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` unchanged, adding each tensor's count and bytes to `tally` ([tensors, bytes])."""
    for name, t in named:
        tally[0] += 1
        tally[1] += t.numel() * t.element_size()
        yield name, t
