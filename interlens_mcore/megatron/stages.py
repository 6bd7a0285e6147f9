"""A pipeline stage as `build_model` builds it: this rank's place in the pipeline, the
TransformerConfig fields megatron's schedules need, and the context a stage is built in (see
`pipeline` for how the stages then run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def pipeline_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def stage() -> tuple[bool, bool]:
    """(first stage, last stage) of this rank; both at PP=1."""
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()


def config_overrides(pp: int, dtype: torch.dtype) -> dict[str, object]:
    """The TransformerConfig fields megatron's schedules need to run a PP-`pp` model's stage."""
    # the loss arrives globally normalised: the schedules must not average it (at any PP size)
    out: dict[str, object] = {"calculate_per_token_loss": True}
    if pp > 1:
        out.update(
            pipeline_model_parallel_size=pp,
            pipeline_dtype=dtype,  # of the activations sent between stages
            variable_seq_lengths=True,  # packed micro-batches differ in length
            # megatron 0.16.1 accepts variable_seq_lengths only with this dispatcher, MoE or not
            moe_token_dispatcher_type="alltoall",
        )
    return out


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    """On a machine without CUDA, `Tensor.cuda()` returns the tensor itself for the block (where it
    would raise): megatron's tied-embedding set-up calls it before an all-reduce gloo can do."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = saved  # type: ignore[method-assign]


def building() -> contextlib.AbstractContextManager:
    """The context `build_model` builds a stage in."""
    return _tensor_cuda_is_identity() if pipeline_size() > 1 else contextlib.nullcontext()


def stage_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's parameters under the names of the whole (PP=1) model: a pipeline stage numbers
    its layers from 0, megatron's `layer_number` (from 1) gives their place in the whole."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    offset = layers[0].layer_number - 1 if layers is not None and len(layers) else 0
    out = {}
    for name, p in model.named_parameters():
        if offset and name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers.") :].split(".", 1)
            name = f"decoder.layers.{int(index) + offset}.{rest}"
        out[name] = p
    return out
