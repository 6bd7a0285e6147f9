"""A megatron-core GPTModel for an HF checkpoint of the Llama or Qwen2 family, and its forward.

`ModelLayout` is the one description of how an HF config maps onto megatron under a TP size;
the model builder, the weight converter and the engine all read it. `forward_logits` is the
single forward used by training and generation.

Example::

    layout = load_layout("path/to/hf_folder")  # TP size from megatron's parallel_state
    model = build_model(layout, init_weights=False)
    load_hf_weights(model, layout, "path/to/hf_folder")  # convert.py
    logits = forward_logits(model, layout, input_ids, cu_seqlens)  # [T, V_pad / tp]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_config import TransformerConfig

from .. import distributed
from . import stages
from .spec import SpecKind, choose_spec, layer_spec, packed_positions

FAMILIES = ("llama", "qwen2")


@dataclass(frozen=True, kw_only=True)
class ModelLayout:
    """How one HF checkpoint maps onto a megatron GPTModel sharded over `tp_size` ranks."""

    family: str  # HF model_type: "llama" or "qwen2"
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int  # grouped-query attention: num_heads / num_kv_heads queries per group
    head_dim: int
    vocab_size: int  # rows of the HF embedding
    padded_vocab_size: int  # vocab_size rounded up to a multiple of tp_size (extra rows unused)
    tp_size: int
    rope_base: float
    norm_eps: float
    qkv_bias: bool  # Qwen2 has biases on q, k, v (and nowhere else)
    tied_embeddings: bool
    max_position: int

    def __post_init__(self) -> None:
        for what, n in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads)):
            if n % self.tp_size:
                raise ValueError(
                    f"TP size {self.tp_size} does not divide {what}={n} of the {self.family} model"
                )
        if self.padded_vocab_size % self.tp_size or self.padded_vocab_size < self.vocab_size:
            raise ValueError(
                f"padded_vocab_size {self.padded_vocab_size} must be a multiple of TP size "
                f"{self.tp_size} and at least vocab_size {self.vocab_size}"
            )

    @property
    def vocab_per_rank(self) -> int:
        return self.padded_vocab_size // self.tp_size


def layout_from_hf_config(hf_config, tp_size: int) -> ModelLayout:
    """Read an HF `PretrainedConfig` of the Llama / Qwen2 family; ValueError for anything else."""
    family = hf_config.model_type
    if family not in FAMILIES:
        raise ValueError(f"HF config model_type {family!r} is not supported; expected one of {FAMILIES}")
    if hf_config.hidden_act != "silu":
        raise ValueError(
            f"{family} config hidden_act {hf_config.hidden_act!r}: only 'silu' (SwiGLU) is supported"
        )
    rope = hf_config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{family} config rope_parameters {rope}: only the default rope_type is supported")
    if family == "llama" and (hf_config.attention_bias or hf_config.mlp_bias):
        raise ValueError("llama config with attention_bias or mlp_bias is not supported")
    if family == "qwen2" and hf_config.use_sliding_window:
        raise ValueError("qwen2 config with use_sliding_window=True is not supported")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    heads = hf_config.num_attention_heads
    vocab = hf_config.vocab_size
    # Qwen2 configs carry no head_dim; HF's own modeling code falls back the same way
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return ModelLayout(
        family=family,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_heads=heads,
        num_kv_heads=hf_config.num_key_value_heads or heads,
        head_dim=head_dim,
        vocab_size=vocab,
        padded_vocab_size=-(-vocab // tp_size) * tp_size,
        tp_size=tp_size,
        rope_base=float(rope.get("rope_theta", 10000.0)),
        norm_eps=hf_config.rms_norm_eps,
        qkv_bias=family == "qwen2",
        tied_embeddings=bool(hf_config.tie_word_embeddings),
        max_position=hf_config.max_position_embeddings,
    )


def load_layout(hf_folder: str | Path, tp_size: int | None = None) -> ModelLayout:
    """Layout of the HF folder's config; tp_size defaults to megatron's TP group size."""
    from transformers import AutoConfig

    if tp_size is None:
        tp_size = distributed.world_size(distributed.megatron_tp_group())
    return layout_from_hf_config(AutoConfig.from_pretrained(hf_folder), tp_size)


def transformer_config(
    layout: ModelLayout, *, params_dtype: torch.dtype = torch.float32, **overrides
) -> TransformerConfig:
    """megatron TransformerConfig of the layout (RMSNorm, SwiGLU, GQA, no linear biases but QKV's).

    `overrides` go to TransformerConfig as they are (e.g. bf16=True, recompute settings).
    """
    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        ffn_hidden_size=layout.ffn_hidden_size,
        num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads,
        kv_channels=layout.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=layout.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # the fused kernels below are CUDA-only; megatron's unfused paths are exact
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=layout.tp_size,
        use_cpu_initialization=not on_gpu,
        params_dtype=params_dtype,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_model(
    layout: ModelLayout,
    *,
    init_weights: bool = True,
    spec: SpecKind | None = None,
    params_dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> GPTModel:
    """A GPTModel for this rank's TP shard; `spec` None: `choose_spec` for where it runs.

    init_weights=False skips megatron's random initialisation (weights are loaded next). On
    GPU, megatron's initialisation needs its CUDA RNG tracker first
    (`tensor_parallel.model_parallel_cuda_manual_seed`), and the caller moves the model with
    `.cuda()` as megatron's own scripts do (torch-native norms are created on the CPU).
    """
    tp = distributed.world_size(distributed.megatron_tp_group())
    if tp != layout.tp_size:
        raise ValueError(f"layout is for TP size {layout.tp_size} but megatron's TP group has {tp} ranks")
    if spec is None:
        spec = choose_spec(cuda=torch.cuda.is_available())
    pp = stages.pipeline_size()
    config_overrides = {**stages.config_overrides(pp, params_dtype), **config_overrides}
    config = transformer_config(
        layout, params_dtype=params_dtype, perform_initialization=init_weights, **config_overrides
    )
    if layout.num_layers % pp:
        raise ValueError(f"PP size {pp} does not divide the model's {layout.num_layers} layers")
    first, last = stages.stage()
    with stages.building():
        model = _gpt_model(config, layout, spec, pre_process=first, post_process=last)
    if not init_weights:
        mark_tp_slices(model)
    return model


def _gpt_model(config: TransformerConfig, layout: ModelLayout, spec: SpecKind, **stage: bool) -> GPTModel:
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec, rotary_base=layout.rope_base),
        vocab_size=layout.padded_vocab_size,
        max_sequence_length=layout.max_position,
        parallel_output=True,  # logits stay vocab-sharded; sampling and losses are vocab-parallel
        share_embeddings_and_output_weights=layout.tied_embeddings,
        # "sdpa_cpu" rotates inside its core attention; the others use megatron's RoPE
        position_embedding_type="none" if spec == "sdpa_cpu" else "rope",
        rotary_base=layout.rope_base,
        **stage,  # pre_process / post_process: this rank's pipeline stage
    )


def mark_tp_slices(model: torch.nn.Module) -> None:
    """Set megatron's `tensor_model_parallel` attributes on every TP slice.

    megatron sets them only inside its weight initialisation, so a model built with
    init_weights=False would leave them unset; megatron's optimizer reads them to count each
    slice once in the gradient norm (unmarked parameters count on TP rank 0 only).
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dims = {"weight": 0, "bias": 0}
        elif isinstance(module, RowParallelLinear):
            dims = {"weight": 1}  # its bias is added after the reduce: a full copy
        else:
            continue
        for name, p in module.named_parameters(recurse=False):
            if name in dims and not getattr(p, "tensor_model_parallel", False):
                # megatron's own setter asserts the attributes are absent; defaults may be set
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dims[name], 1


def packed_seq_params(cu_seqlens: torch.Tensor) -> PackedSeqParams:
    """THD parameters for sequences packed back to back; cu_seqlens [N + 1] starts at 0."""
    cu = cu_seqlens.to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )


def forward_logits(
    model: torch.nn.Module,
    layout: ModelLayout,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's vocabulary shard of the logits; padded vocabulary entries are -inf.

    `compute_dtype` (e.g. torch.bfloat16): the forward runs under autocast to it (weights stay
    in their own dtype, the optimizer's master copy) and the logits come back as float32.

    Packed: input_ids [1, T] with cu_seqlens [N + 1] -> [T, V_pad / tp] (positions restart
    per sequence). Unpacked: input_ids [B, T], causal, right padding only -> [B, T, V_pad / tp].
    `rows` (packed only): positions of the row whose logits are wanted -> [len(rows), V_pad / tp];
    the output layer then projects those positions alone (see `output_rows`).
    """
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    if rows is not None and cu_seqlens is None:
        raise ValueError("forward_logits(rows=...) needs a packed batch (cu_seqlens)")
    with compute_autocast(device.type, compute_dtype), output_rows(model, rows):
        logits = _forward(model, input_ids, cu_seqlens, device)
    if compute_dtype is not None:
        logits = logits.float()
    return mask_padded_vocab(logits, layout)


@contextlib.contextmanager
def output_rows(model: torch.nn.Module, rows: torch.Tensor | None) -> Iterator[None]:
    """Within the block the model's output layer projects the hidden states at `rows` alone
    (positions of a packed row); nothing changes when `rows` is None.

    A loss over some positions (a reply's tokens) needs no logits elsewhere. With a large
    vocabulary the output layer and the softmax over it are a large share of a small model's
    forward and backward (SmolLM2: 28M of its 135M parameters), and a prompt's positions are
    most of a row. The logits at the kept positions are those of the whole projection: the same
    hidden states times the same weight.
    """
    if rows is None:
        yield
        return
    layer = _bare(model).output_layer
    assert isinstance(layer, torch.nn.Module), "a GPTModel's last stage has an output layer"
    project = layer.forward

    def forward(hidden: torch.Tensor, *args, **kwargs):  # hidden [T, 1, H]: sequence first
        return project(hidden.index_select(0, rows.to(hidden.device)), *args, **kwargs)

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward  # the class's own forward again


def _bare(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel under wrappers that keep it as `.module` (torch's or megatron's DDP)."""
    while not hasattr(model, "output_layer") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module  # type: ignore[assignment]
    return model


def compute_autocast(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device_type`; nothing when `dtype` is None."""
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _forward(model: torch.nn.Module, input_ids: torch.Tensor, cu_seqlens, device) -> torch.Tensor:
    if cu_seqlens is None:
        positions = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
        logits = model(input_ids=input_ids, position_ids=positions, attention_mask=None)  # [B, T, V/tp]
    else:
        if input_ids.shape[0] != 1 or int(cu_seqlens[-1]) != input_ids.shape[1]:
            raise ValueError(
                f"packed input_ids must be [1, T] with cu_seqlens[-1] == T, got shape "
                f"{tuple(input_ids.shape)} and cu_seqlens[-1]={int(cu_seqlens[-1])}"
            )
        params = packed_seq_params(cu_seqlens.to(device))
        positions = packed_positions(cu_seqlens).to(device)[None]  # [1, T]
        logits = model(
            input_ids=input_ids, position_ids=positions, attention_mask=None, packed_seq_params=params
        )
        logits = logits[0]  # [T, V/tp]
    return logits


def vocab_start(layout: ModelLayout) -> int:
    """First global token id of this rank's vocabulary shard."""
    return distributed.rank(distributed.megatron_tp_group()) * layout.vocab_per_rank


def mask_padded_vocab(logits: torch.Tensor, layout: ModelLayout) -> torch.Tensor:
    """-inf on ids >= vocab_size, so padding is never sampled and adds nothing to softmax sums."""
    start = vocab_start(layout)
    if start + logits.shape[-1] <= layout.vocab_size:
        return logits
    ids = torch.arange(start, start + logits.shape[-1], device=logits.device)
    return logits.masked_fill(ids >= layout.vocab_size, float("-inf"))
