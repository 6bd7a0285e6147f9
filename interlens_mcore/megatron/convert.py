"""HF safetensors <-> megatron-core GPTModel weights for the Llama / Qwen2 families, under TP.

Every megatron parameter is described once (`param_map`): which HF tensors it is fused from
and how it is split over TP ranks. Import fuses the HF tensors into the TP=1 megatron layout
and keeps this rank's shard; export gathers the shards over the TP group, joins them into the
TP=1 layout and splits that back into HF tensors. The two directions share the table, so a
round trip reproduces every HF tensor bit for bit.

Megatron layouts (TP=1, then sharded):
- linear_qkv: for each of the ng key/value groups, its q heads, then its k head, then its v
  head: [ng * (q_per_group + 2) * hn, h]. Groups are contiguous, so TP splits dim 0.
- linear_fc1 (SwiGLU): [gate; up] per rank, so rank r holds [gate_r; up_r], not a slice of
  [gate; up].
- embeddings / output layer: vocab rows padded with zeros to a multiple of TP, split dim 0.
- linear_proj, linear_fc2: split along the input dim (row-parallel); norms are replicated.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import distributed
from .lora import merged_weights
from .model import ModelLayout
from .stages import pipeline_size, stage_parameters

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
# the files of a sharded megatron checkpoint folder (checkpoint.py) that never belong in an HF one
MEGATRON_MARKER = "megatron.json"
CHECKPOINT_FILES = (MEGATRON_MARKER, "manifest.json", "meta.json")


@dataclass(frozen=True)
class ParamRule:
    """One megatron parameter: its HF sources, how they fuse, how the result is split over TP."""

    megatron: str
    hf: tuple[str, ...]
    fuse: str  # "copy" | "qkv" | "glu" | "vocab" | "shared" (one tensor, the same for each HF name)
    split: str  # "replicated" | "rows" | "cols" | "glu_rows"
    stored_as: str = ""  # the checkpoint key when it is another parameter's (a tied copy)

    @property
    def adapter(self) -> bool:
        """A LoRA adapter's matrix (`lora.py`), not a weight of the model itself."""
        return ".lora_" in self.megatron


def param_map(layout: ModelLayout, megatron_names: set[str]) -> list[ParamRule]:
    """The rules for every parameter of a GPTModel built for `layout`.

    `megatron_names` picks the norm names: Transformer Engine's spec fuses the pre-attention
    and pre-MLP norms into linear_qkv / linear_fc1 (`layer_norm_weight`).
    """
    te_norms = any(n.endswith(".self_attention.linear_qkv.layer_norm_weight") for n in megatron_names)
    rules = [ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "rows")]
    for i in range(layout.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn, mlp = m + "self_attention.", m + "mlp."
        qkv = [f"{h}self_attn.{x}_proj" for x in "qkv"]
        attn_norm = attn + "linear_qkv.layer_norm_weight" if te_norms else m + "input_layernorm.weight"
        mlp_norm = mlp + "linear_fc1.layer_norm_weight" if te_norms else m + "pre_mlp_layernorm.weight"
        gate_up = (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight")
        rules += [
            ParamRule(attn_norm, (h + "input_layernorm.weight",), "copy", "replicated"),
            ParamRule(attn + "linear_qkv.weight", tuple(x + ".weight" for x in qkv), "qkv", "rows"),
            ParamRule(attn + "linear_proj.weight", (h + "self_attn.o_proj.weight",), "copy", "cols"),
            ParamRule(mlp_norm, (h + "post_attention_layernorm.weight",), "copy", "replicated"),
            ParamRule(mlp + "linear_fc1.weight", gate_up, "glu", "glu_rows"),
            ParamRule(mlp + "linear_fc2.weight", (h + "mlp.down_proj.weight",), "copy", "cols"),
        ]
        if layout.qkv_bias:
            rules.append(ParamRule(attn + "linear_qkv.bias", tuple(x + ".bias" for x in qkv), "qkv", "rows"))
    rules.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", "replicated"))
    if not layout.tied_embeddings:
        rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), "vocab", "rows"))
    return rules


def adapter_rules(rules: list[ParamRule], names: set[str]) -> list[ParamRule]:
    """Rules for the LoRA adapters among `names` (`lora.attach`), from their layers' rules.

    A column-parallel layer's A is whole on every rank, and shared by the HF projections it
    fuses (peft gives each projection its own A: the same one here); its B is split and fused
    like the weight. A row-parallel layer's A is split like the weight's columns, its B whole.
    HF names are peft's (`...q_proj.lora_A.weight`).
    """
    out = []
    for rule in rules:
        stem = rule.megatron.removesuffix(".weight")
        if f"{stem}.lora_A.weight" not in names:
            continue
        column = rule.split != "cols"
        hf = [h.removesuffix(".weight") for h in rule.hf]
        a_fuse = "shared" if len(hf) > 1 else "copy"
        out += [
            ParamRule(
                f"{stem}.lora_A.weight",
                tuple(f"{h}.lora_A.weight" for h in hf),
                a_fuse,
                "replicated" if column else "cols",
            ),
            ParamRule(
                f"{stem}.lora_B.weight",
                tuple(f"{h}.lora_B.weight" for h in hf),
                rule.fuse,
                rule.split if column else "replicated",
            ),
        ]
    return out


# ---- fusing HF tensors into the TP=1 megatron layout, and back ----


def _fuse(rule: ParamRule, layout: ModelLayout, tensors: list[torch.Tensor]) -> torch.Tensor:
    if rule.fuse in ("copy", "shared"):
        return tensors[0]
    if rule.fuse == "glu":
        return torch.cat(tensors, dim=0)  # [2F, h]
    if rule.fuse == "vocab":
        (t,) = tensors
        pad = t.new_zeros((layout.padded_vocab_size - t.shape[0], *t.shape[1:]))
        return torch.cat([t, pad], dim=0)  # [V_pad, h]
    ng, hn = layout.num_kv_heads, layout.head_dim
    q, k, v = tensors
    rest = q.shape[1:]  # (h,) for weights, () for biases
    per_group = [q.reshape(ng, -1, *rest), k.reshape(ng, hn, *rest), v.reshape(ng, hn, *rest)]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)  # [ng * (q_per_group + 2) * hn, ...]


def _unfuse(rule: ParamRule, layout: ModelLayout, full: torch.Tensor) -> list[torch.Tensor]:
    if rule.fuse == "copy":
        return [full]
    if rule.fuse == "shared":  # copies: each HF name is a tensor of its own (safetensors refuses aliases)
        return [full.clone() for _ in rule.hf]
    if rule.fuse == "glu":
        return list(full.chunk(2, dim=0))
    if rule.fuse == "vocab":
        return [full[: layout.vocab_size]]
    ng, hn = layout.num_kv_heads, layout.head_dim
    q_width = layout.num_heads // ng * hn
    grouped = full.reshape(ng, q_width + 2 * hn, *full.shape[1:])
    q, k, v = grouped.split([q_width, hn, hn], dim=1)
    return [x.reshape(-1, *full.shape[1:]) for x in (q, k, v)]


# ---- splitting the TP=1 layout over TP ranks, and joining ----


def _split(rule: ParamRule, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    if rule.split == "replicated":
        return [full] * tp
    if rule.split == "cols":
        return list(full.chunk(tp, dim=1))
    if rule.split == "glu_rows":  # rank r gets [gate_r; up_r]
        halves = full.reshape(2, -1, *full.shape[1:]).chunk(tp, dim=1)
        return [h.reshape(-1, *full.shape[1:]) for h in halves]
    return list(full.chunk(tp, dim=0))


def _join(rule: ParamRule, shards: list[torch.Tensor]) -> torch.Tensor:
    if rule.split == "replicated":
        return shards[0]
    if rule.split == "cols":
        return torch.cat(shards, dim=1)
    if rule.split == "glu_rows":
        halves = [s.reshape(2, -1, *s.shape[1:]) for s in shards]
        joined = torch.cat(halves, dim=1)
        return joined.reshape(-1, *joined.shape[2:])
    return torch.cat(shards, dim=0)


# ---- reading and writing ----


def _hf_reader(folder: Path) -> Callable[[str], torch.Tensor]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"HF folder {folder} has no *.safetensors weights")
    where = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            where.update(dict.fromkeys(sf.keys(), f))

    def read(name: str) -> torch.Tensor:
        if name not in where:
            raise ValueError(f"HF folder {folder} has no tensor {name!r}")
        with safe_open(where[name], framework="pt") as sf:
            return sf.get_tensor(name)

    return read


def _checked_rules(model: torch.nn.Module, layout: ModelLayout) -> tuple[list[ParamRule], dict]:
    params = stage_parameters(model)
    rules = param_map(layout, set(params))
    rules += adapter_rules(rules, set(params))
    if pipeline_size() > 1:
        # a stage holds some of the whole model's parameters; with tied embeddings the last
        # stage's output layer is its own copy of the embedding
        rules = [r for r in rules if r.megatron in params]
        if layout.tied_embeddings and "output_layer.weight" in params:
            embed = ("model.embed_tokens.weight",)
            # one weight: stored once, under its first name
            tied = ParamRule(
                "output_layer.weight", embed, "vocab", "rows", stored_as="embedding.word_embeddings.weight"
            )
            rules.append(tied)
    unknown = set(params) - {r.megatron for r in rules}
    missing = {r.megatron for r in rules} - set(params)
    if unknown or missing:
        raise ValueError(
            f"GPTModel parameters do not match the {layout.family} layout (pass the bare GPTModel, "
            f"not a wrapper): unknown {sorted(unknown)[:4]}, missing {sorted(missing)[:4]}"
        )
    return rules, params


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, layout: ModelLayout, hf_folder: str | Path) -> None:
    """Copy this rank's TP shard of every HF tensor into `model` (every weight is set; LoRA
    adapters are `lora.attach`'s)."""
    rules, params = _checked_rules(model, layout)
    read = _hf_reader(Path(hf_folder))
    tp_rank = distributed.rank(distributed.megatron_tp_group())
    for rule in (r for r in rules if not r.adapter):
        full = _fuse(rule, layout, [read(n) for n in rule.hf])
        shard = _split(rule, full, layout.tp_size)[tp_rank]
        param = params[rule.megatron]
        if shard.shape != param.shape:
            raise ValueError(
                f"{rule.hf} give a shard of shape {tuple(shard.shape)} for {rule.megatron}, "
                f"whose shape is {tuple(param.shape)}"
            )
        param.copy_(shard)


@torch.no_grad()
def gather_hf_state_dict(model: torch.nn.Module, layout: ModelLayout) -> dict[str, torch.Tensor]:
    """Full HF tensors (on CPU) from this rank's shards; collective over the TP group. LoRA
    adapters, when on, are merged into their weights: the model as it computes."""
    rules, params = _checked_rules(model, layout)
    merged = merged_weights(model)
    return _gather([r for r in rules if not r.adapter], layout, lambda n: merged.get(n, params[n]))


def stage_hf_state_dict(model: torch.nn.Module, layout: ModelLayout) -> dict[str, torch.Tensor]:
    """This pipeline stage's own HF tensors (`gather_hf_state_dict`), the embedding held by the
    first stage alone: a later stage's tied copy of it is left out, so the stages' tensors are
    disjoint and together the whole model. At PP=1 the whole model."""
    state = gather_hf_state_dict(model, layout)
    if layout.tied_embeddings and pipeline_size() > 1:
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_rank() > 0:  # the last stage's copy of the embedding
            state.pop("model.embed_tokens.weight", None)
    return state


@torch.no_grad()
def gather_adapter_state_dict(model: torch.nn.Module, layout: ModelLayout) -> dict[str, torch.Tensor]:
    """The LoRA adapters as full tensors under peft's names (`lora_A` / `lora_B` of each HF
    projection, without peft's `base_model.model.` prefix); collective over the TP group."""
    rules, params = _checked_rules(model, layout)
    return _gather([r for r in rules if r.adapter], layout, params.__getitem__)


def _gather(
    rules: list[ParamRule], layout: ModelLayout, local: Callable[[str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    group = distributed.megatron_tp_group()
    state = {}
    for rule in rules:
        shards = distributed.all_gather_tensor(local(rule.megatron).detach(), group)
        for name, tensor in zip(rule.hf, _unfuse(rule, layout, _join(rule, shards)), strict=True):
            state[name] = tensor.cpu().contiguous()
    return state


def export_hf(
    model: torch.nn.Module,
    layout: ModelLayout,
    src_folder: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model` as an HF folder that `from_pretrained` loads; call on every rank.

    Shards are gathered over each TP group. At PP=1 global rank 0 writes `model.safetensors` (one
    file); under pipeline parallelism each stage's first TP rank of data-parallel index 0 writes
    its own layers as `model-0000K-of-0000P.safetensors` and rank 0 writes HF's
    `model.safetensors.index.json`, so no stage's weights travel to another (a tied embedding is
    written once, by the first stage). Tensors are in the parameters' dtype, or `dtype`. Global
    rank 0 copies every non-weight file of `src_folder` (config, generation config, tokenizer,
    chat template; an HF folder or a sharded megatron checkpoint, whose own files are left out).
    Ends with a barrier over the world.
    """
    src, out = Path(src_folder), Path(out_dir)
    state = stage_hf_state_dict(model, layout)
    if dtype is not None:  # megatron's norms stay float32 in a bfloat16 model
        state = {k: v.to(dtype) for k, v in state.items()}
    from safetensors.torch import save_file

    if distributed.rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        for f in out.glob("model*.safetensors*"):  # an earlier export's weights, which HF would prefer
            f.unlink()
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name not in CHECKPOINT_FILES:
                shutil.copy2(f, out / f.name)
    stages = pipeline_size()
    if stages == 1:
        if distributed.rank() == 0:
            save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        distributed.barrier()
        return out
    from megatron.core import parallel_state as ps

    stage_rank = ps.get_pipeline_model_parallel_rank()
    writes = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    name = f"model-{stage_rank + 1:05d}-of-{stages:05d}.safetensors"
    distributed.barrier()  # the folder exists
    if writes:
        save_file(state, out / name, metadata={"format": "pt"})
    sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
    # names and sizes only: the weights stay with their stage
    written = distributed.all_gather_object((name, sizes) if writes else None)
    if distributed.rank() == 0:
        import json

        weight_map: dict[str, str] = {}
        total = 0
        for item in written:
            if item is not None:
                file, file_sizes = item
                weight_map.update(dict.fromkeys(file_sizes, file))
                total += sum(file_sizes.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    distributed.barrier()
    return out
