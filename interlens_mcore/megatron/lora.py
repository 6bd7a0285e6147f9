"""LoRA adapters on megatron-core's column- and row-parallel linear layers, exact under TP.

An adapted layer computes `y = W x + scale * B (A x)` with `scale = alpha / rank`. Its
adapters are split over TP the way its weight is, so TP=2 computes what TP=1 computes:

- column-parallel (`linear_qkv`, `linear_fc1`; W split by output rows): A [r, in] is whole on
  every rank, B [out / tp, r] is this rank's rows of B. `A x` is the same on every rank; it
  passes megatron's `copy_to_tensor_model_parallel_region` (identity forward, all-reduce of
  the gradient), so A's gradient is the sum over the B shards: the whole gradient, on every rank.
- row-parallel (`linear_proj`, `linear_fc2`; W split by input columns): A [r, in / tp] is this
  rank's columns of A, B [out, r] is whole. `A_r x_r` is summed over TP with
  `reduce_from_tensor_model_parallel_region`, as the layer sums `W_r x_r`; B's gradient is then
  the same on every rank.

A fused layer adapts as one: `linear_qkv` holds q, k and v, `linear_fc1` gate and up. Naming
only some of them (`--lora-target-modules q_proj,v_proj`) keeps B's rows of the others at zero
(a fixed mask), so the exported adapter is peft's for exactly the named projections, each
with the shared A. Dropout draws its mask for the whole input width from a generator seeded by
the layer and the model forward's number, the same on every TP rank, and keeps this rank's part:
the same masks at any TP, and again when a layer is recomputed in the backward.

The adapters are registered on the layer (`<layer>.lora_A.weight`, `<layer>.lora_B.weight`),
so the base weights keep their names for checkpoints and the HF conversion
(`convert.adapter_rules`); a forward hook adds the adapters' term. The base is frozen.

Example::

    state = attach(model, layout, LoRAOptions(rank=8, alpha=16))
    with adapters_off(model):        # the base model: the KL reference, no second copy
        ref = forward_logits(model, layout, ids, cu)
    merged = merged_weights(model)   # W + scale * B A per adapted weight (export, vLLM)
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import distributed
from .model import ModelLayout
from .stages import stage_parameters

# each megatron layer and the HF projections it fuses, in the order they are fused
HF_PROJECTIONS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
_ATTRIBUTE = "_interlens_lora"  # where `attach` leaves the LoRAState on the model


@dataclass(frozen=True, kw_only=True)
class LoRAOptions:
    """The adapters' shape: peft's and ms-swift's names (`r`, `lora_alpha`, `lora_dropout`,
    `target_modules`); target names are HF projections or megatron layers, or "all-linear"."""

    rank: int
    alpha: float = 32.0
    dropout: float = 0.05  # as --lora-dropout (ms-swift's default)
    target_modules: str | tuple[str, ...] = "all-linear"
    seed: int = 0  # A's initialisation and the dropout masks

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRAOptions.rank must be >= 1, got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRAOptions.alpha must be a finite number > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRAOptions.dropout must be in [0, 1), got {self.dropout}")
        targets(self.target_modules)  # names checked here, before any model is touched

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def targets(target_modules: str | tuple[str, ...] | list[str]) -> dict[str, tuple[str, ...]]:
    """megatron layer -> the HF projections adapted in it, from peft-style target names."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if names == ["all-linear"]:
        return dict(HF_PROJECTIONS)
    layer_of = {hf: layer for layer, hfs in HF_PROJECTIONS.items() for hf in hfs}
    out: dict[str, list[str]] = {}
    for name in names:
        if name in HF_PROJECTIONS:
            out.setdefault(name, []).extend(HF_PROJECTIONS[name])
        elif name in layer_of:
            out.setdefault(layer_of[name], []).append(name)
        else:
            known = ", ".join([*layer_of, *HF_PROJECTIONS])
            raise ValueError(
                f"LoRA target module {name!r} is not a linear layer of the Megatron model; "
                f"expected all-linear or names among {known}"
            )
    # in the fused order, once each
    return {layer: tuple(hf for hf in HF_PROJECTIONS[layer] if hf in hfs) for layer, hfs in out.items()}


@dataclass(eq=False)
class _Adapter:
    """What one adapted layer's hook needs besides its parameters."""

    column: bool  # column-parallel (A whole, B split) or row-parallel (A split, B whole)
    in_full: int  # the layer's input width at TP=1 (the dropout mask's width)
    in_offset: int  # where this rank's input columns start (row-parallel)
    mask: torch.Tensor | None  # [out / tp] 1 for adapted output rows (None: all of them)
    seed: int

    def dropout(self, x: torch.Tensor, p: float, forward: int) -> torch.Tensor:
        # a generator of its own per model forward: a layer recomputed in the backward
        # (activation checkpointing) draws the mask it drew in the forward. torch's CPU generator
        # keeps a seed's low 32 bits only: the forward's number is mixed into them (an odd
        # multiplier, so a layer's forwards never share a seed)
        gen = torch.Generator(x.device).manual_seed((self.seed + forward * 0x9E3779B1) % 2**32)
        keep = torch.rand((*x.shape[:-1], self.in_full), generator=gen, device=x.device) >= p
        keep = keep[..., self.in_offset : self.in_offset + x.shape[-1]]
        return x * keep.to(x.dtype) / (1.0 - p)


@dataclass(eq=False)
class LoRAState:
    """The adapters of one model: its options, and whether the hooks add their term."""

    options: LoRAOptions
    layers: dict[str, tuple[str, ...]]  # megatron layer kind -> adapted HF projections
    # global weight name -> (the weight, A, B, the hook's state)
    adapted: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Adapter]] = field(
        default_factory=dict
    )
    enabled: bool = True
    forwards: int = 0  # model forwards so far (a pre-hook on the model counts them): dropout's seed


def state_of(model: torch.nn.Module) -> LoRAState | None:
    """The model's LoRAState, None when no adapters are attached."""
    return model.__dict__.get(_ATTRIBUTE)


def attach(
    model: torch.nn.Module, layout: ModelLayout, options: LoRAOptions, *, dtype: torch.dtype | None = None
) -> LoRAState:
    """Freeze the bare GPTModel and give each targeted linear layer LoRA adapters (B zero, so the
    model computes what it did); A is initialised as peft does, from a generator seeded by the
    layer's global name, and split over TP like the weight: the same adapters at any TP.

    `dtype`: the adapters' (None: their layer's); float32 adapters over a bfloat16 base train
    with a plain optimizer while the frozen base takes half the memory."""
    if state_of(model) is not None:
        raise ValueError("attach: the model already has LoRA adapters")
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    chosen = targets(options.target_modules)
    global_name = {id(p): name for name, p in stage_parameters(model).items()}
    tp, tp_rank = layout.tp_size, distributed.rank(distributed.megatron_tp_group())
    model.requires_grad_(False)
    state = LoRAState(options=options, layers=chosen)
    for local, module in list(model.named_modules()):
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if local == "output_layer":  # frozen now: see _StridedGrad
            module.register_forward_hook(_standard_strides)
        # "decoder.layers.{i}.{self_attention|mlp}.{kind}.weight"; a tied output layer has no weight
        name = global_name.get(id(module.weight), "")
        kind = name.split(".")[-2] if name else ""
        if kind not in chosen:
            continue  # the output layer, or a layer not named
        if module.sequence_parallel:
            raise ValueError("LoRA adapters do not run with sequence parallelism (sequence_parallel=False)")
        column = kind in COLUMN_PARALLEL
        out_local, in_local = module.weight.shape
        in_full = in_local if column else in_local * tp
        seed = zlib.crc32(f"{options.seed}:{name}".encode())
        # peft's kaiming_uniform_(a=sqrt(5)) on the whole A: uniform in +-1/sqrt(fan_in)
        bound = 1.0 / math.sqrt(in_full)
        gen = torch.Generator().manual_seed(seed)
        a = (torch.rand(options.rank, in_full, generator=gen, dtype=torch.float64) * 2 - 1) * bound
        if not column:
            a = a[:, tp_rank * in_local : (tp_rank + 1) * in_local]
        w = module.weight
        own = dtype or w.dtype
        lora_a = torch.nn.Linear(in_local, options.rank, bias=False, device=w.device, dtype=own)
        lora_b = torch.nn.Linear(options.rank, out_local, bias=False, device=w.device, dtype=own)
        module.lora_A, module.lora_B = lora_a, lora_b
        with torch.no_grad():
            lora_a.weight.copy_(a)
            lora_b.weight.zero_()
        # megatron's TP attributes: its gradient norm counts a slice on every rank, a whole copy once
        split = lora_b.weight if column else lora_a.weight
        set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
        mask = _row_mask(kind, layout, chosen[kind])
        adapter = _Adapter(
            column=column,
            in_full=in_full,
            in_offset=0 if column else tp_rank * in_local,
            mask=None if mask is None else mask.to(w.device, own),
            seed=seed + 1,
        )
        module.register_forward_hook(_hook(state, adapter))
        state.adapted[name] = (w, lora_a.weight, lora_b.weight, adapter)
    if not state.adapted:
        raise ValueError(f"LoRA target modules {options.target_modules!r} adapt no layer of this model")

    def count(module, args) -> None:  # on the whole model: a recomputed layer does not run it again
        state.forwards += 1

    model.register_forward_pre_hook(count)
    model.__dict__[_ATTRIBUTE] = state
    return state


class _StridedGrad(torch.autograd.Function):
    """Identity; its gradient gets a standard layout.

    megatron's linear with a frozen weight computes its input gradient as `grad.matmul(weight)`.
    The output layer's gradient arrives as the transpose of a [1, T, V] tensor: [T, 1, V] with
    strides (V, T * V, 1). torch counts that contiguous (the size-1 dimension's stride does not
    matter), so `.contiguous()` keeps it, but matmul will not fold it into one [T, V] matrix and
    broadcasts the weight to [T, V, H] instead: 21 GB and 35 s for 400 tokens of SmolLM2. (A
    trainable weight takes megatron's other path, which reshapes the gradient itself.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone(memory_format=torch.contiguous_format)  # strides from the sizes


def _standard_strides(module, args, output):
    out, bias = output
    return (_StridedGrad.apply(out) if out.requires_grad else out), bias


def _row_mask(kind: str, layout: ModelLayout, adapted: tuple[str, ...]) -> torch.Tensor | None:
    """[out / tp] 1.0 on this rank's output rows of the adapted projections; None when all are."""
    if adapted == HF_PROJECTIONS[kind]:
        return None
    hn, tp = layout.head_dim, layout.tp_size
    on = {hf: float(hf in adapted) for hf in HF_PROJECTIONS[kind]}
    if kind == "linear_qkv":  # a rank's key/value groups, each [its q heads; k; v] (convert.py)
        group = [
            torch.full((layout.num_heads // layout.num_kv_heads * hn,), on["q_proj"]),
            torch.full((hn,), on["k_proj"]),
            torch.full((hn,), on["v_proj"]),
        ]
        return torch.cat(group).repeat(layout.num_kv_heads // tp)
    # linear_fc1: a rank holds [gate_r; up_r]
    rows = layout.ffn_hidden_size // tp
    return torch.cat([torch.full((rows,), on["gate_proj"]), torch.full((rows,), on["up_proj"])])


def _hook(state: LoRAState, adapter: _Adapter):
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    group = distributed.megatron_tp_group()
    p = state.options.dropout

    def add_adapters(module, args, output):
        if not state.enabled:
            return output
        out, bias = output
        x = args[0]  # [..., in (/ tp)]
        if p and module.training:
            x = adapter.dropout(x, p, state.forwards)
        h = F.linear(x, module.lora_A.weight)  # [..., r]
        b = module.lora_B.weight if adapter.mask is None else module.lora_B.weight * adapter.mask[:, None]
        if adapter.column:
            h = copy_to_tensor_model_parallel_region(h, group=group)  # A's gradient: summed over TP
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=group)  # sum_r A_r x_r
        return out + F.linear(h, b) * state.options.scale, bias

    return add_adapters


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model for the length of the block (the KL reference with LoRA)."""
    state = state_of(model)
    if state is None:
        raise ValueError("adapters_off: the model has no LoRA adapters")
    was, state.enabled = state.enabled, False
    try:
        yield
    finally:
        state.enabled = was


def forward_number(model: torch.nn.Module) -> int:
    """How many forwards the model has run (LoRA dropout's seed is the next one's); 0 without
    adapters."""
    state = state_of(model)
    return 0 if state is None else state.forwards


@contextlib.contextmanager
def replaying(model: torch.nn.Module, forwards: list[int]) -> Iterator[Callable[[int], None]]:
    """For the length of the block, `before(i)` (called before forward `i` of a replay) makes that
    forward draw the dropout masks of the forward that came after `forwards[i]` forwards; after
    the block the count is where it was. Without adapters `before` does nothing."""
    state = state_of(model)
    if state is None:
        yield lambda i: None
        return
    saved = state.forwards

    def before(i: int) -> None:
        state.forwards = forwards[i]  # the model's pre-hook then counts this forward as the next

    try:
        yield before
    finally:
        state.forwards = saved


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Global weight name -> this rank's shard of W + scale * B A (no collective): the adapted
    layers as one plain weight, for an HF export or an engine that takes plain weights."""
    state = state_of(model)
    if state is None or not state.enabled:
        return {}
    out = {}
    for name, (weight, a, b, adapter) in state.adapted.items():
        b = b.float() if adapter.mask is None else b.float() * adapter.mask[:, None].float()
        delta = (b @ a.float()) * state.options.scale
        out[name] = (weight.float() + delta).to(weight.dtype)
    return out


def save_peft(
    folder: str | Path, tensors: dict[str, torch.Tensor], options: LoRAOptions, *, base_model: str
) -> Path:
    """Write adapters (`convert.gather_adapter_state_dict`'s, whole) as peft's `save_pretrained`
    does: `adapter_config.json` from peft's own `LoraConfig` and `adapter_model.safetensors`
    under peft's names. Only the projections `options` adapts are written."""
    from safetensors.torch import save_file

    LoraConfig = peft_config_class()
    adapted = {hf for hfs in targets(options.target_modules).values() for hf in hfs}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(
        r=options.rank,
        lora_alpha=options.alpha,  # peft computes alpha / r in floats
        lora_dropout=options.dropout,
        target_modules=sorted(adapted),
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )
    config.save_pretrained(str(folder))
    kept = {  # "model.layers.0.self_attn.q_proj.lora_A.weight": the projection is third from the end
        f"base_model.model.{name}": t for name, t in tensors.items() if name.split(".")[-3] in adapted
    }
    save_file(kept, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def peft_config_class():
    """peft's `LoraConfig`; ValueError naming the extra to install when peft is missing."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise ValueError(
            "--lora-rank writes its adapters in peft's layout, and peft is not installed "
            "(pip install -e '.[lora]')"
        ) from None
    return LoraConfig
