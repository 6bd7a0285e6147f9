"""Sharded checkpoints of a GPTModel and its optimizer that reshard: save at one TP, load at another.

Storage is torch.distributed.checkpoint (DCP): each tensor is saved once under its megatron
name with its full (TP=1) shape, and every rank writes only its own block of it. Loading reads,
for each rank, the parts of the saved blocks that overlap its own block, whatever TP size
wrote them. How each parameter is split over TP comes from the same table as the HF
conversion (`convert.param_map`), so one description serves both:

- "rows" / "cols": the block is this rank's slice along dim 0 / dim 1;
- "glu_rows" (SwiGLU linear_fc1, rank r holds [gate_r; up_r]): viewed as [2, F / tp, h], the
  block of a [2, F, h] tensor, so gate and up each keep their own TP split;
- vocabulary rows are stored at the true vocabulary size: the zero rows that pad it to a
  multiple of TP are not saved and are zeroed on load, so TP=2's padded 516 rows and TP=1's
  515 describe the same stored tensor;
- "replicated" (norms): a plain tensor, written once.

Optimizer state of a torch optimizer (AdamW on the CPU path: per-parameter tensors shaped
like the parameter, plus scalars like `step`) is stored under `optimizer.<state>.<parameter
name>` with the parameter's split, so it reshards the same way; the hyperparameters of its
parameter groups are stored as JSON in a byte tensor (no checkpoint file is a pickle of this
package: see `interlens_mcore.distributed.safe_load`). A megatron optimizer (the GPU path: fp32 main
weights and moments, sharded over DP by the distributed optimizer) is stored by megatron's
own `dist_checkpointing` under `optimizer/`, built against the model's `sharded_state_dict`.

The model does not go through megatron-core's `dist_checkpointing.save` (torch_dist
strategy): in 0.16 its writer calls `torch.cuda.synchronize()` and starts a multiprocessing
manager, so it cannot run on CPU ranks. The files are DCP's own format; `saved_tensors` lists
what a folder holds.

Layout of a checkpoint folder::

    megatron.json    format, model family and shapes, the TP size that wrote it
    weights/         DCP files (.metadata, __<rank>_<n>.distcp): the model, a torch optimizer
    optimizer/       a megatron optimizer's state (GPU path only)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import distributed
from ..distributed import safe_load
from .convert import MEGATRON_MARKER, ParamRule, _checked_rules, _join
from .lora import state_of
from .model import ModelLayout

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer

FORMAT = "interlens_mcore.megatron.checkpoint/1"
MARKER, WEIGHTS = MEGATRON_MARKER, "weights"
OPTIMIZER = "optimizer"
HYPERPARAMETERS = f"{OPTIMIZER}.param_groups.json"  # a uint8 tensor of JSON
_PICKLED_HYPERPARAMETERS = f"{OPTIMIZER}.param_groups"  # an earlier format: a pickled object


def is_megatron_checkpoint(path: str | Path) -> bool:
    """True when `path` is a folder written by `save` (it holds megatron.json and weights/)."""
    path = Path(path)
    return (path / MARKER).is_file() and (path / WEIGHTS).is_dir()


def read_marker(path: str | Path) -> dict:
    """The folder's megatron.json; ValueError naming the folder if it is not a checkpoint."""
    path = Path(path)
    if not is_megatron_checkpoint(path):
        raise ValueError(f"{path} is not a sharded megatron checkpoint (no {MARKER} and {WEIGHTS}/)")
    marker = json.loads((path / MARKER).read_text())
    if marker.get("format") != FORMAT:
        raise ValueError(f"{path / MARKER}: format {marker.get('format')!r}, expected {FORMAT!r}")
    return marker


# ---- blocks: where this rank's tensor sits in the full one ----


def _block(rule: ParamRule, layout: ModelLayout, tensor: torch.Tensor) -> distributed.Block | None:
    """This rank's block of `tensor` (a parameter or a state shaped like it); None if replicated."""
    tp, r = layout.tp_size, distributed.rank(distributed.megatron_tp_group())
    if rule.split == "replicated":
        return None
    shape = tuple(tensor.shape)
    if rule.fuse == "vocab":  # true vocabulary rows only: padding is not part of the model
        per = layout.vocab_per_rank
        rows = [max(0, min(per, layout.vocab_size - i * per)) for i in range(tp)]
        assert min(rows) > 0, "every TP rank holds at least one real vocabulary row"
        rest = shape[1:]
        zeros = (0,) * len(rest)
        return distributed.Block(
            local=tensor[: rows[r]],
            global_shape=(layout.vocab_size, *rest),
            offsets=tuple((i * per, *zeros) for i in range(tp)),
            shapes=tuple((n, *rest) for n in rows),
        )
    if rule.split == "glu_rows":  # [gate_r; up_r] is the block (:, r) of [2, F, h]
        local = tensor.view(2, shape[0] // 2, *shape[1:])
        dim = 1
    else:
        local, dim = tensor, (0 if rule.split == "rows" else 1)
    lshape = tuple(local.shape)
    gshape = tuple(n * tp if d == dim else n for d, n in enumerate(lshape))
    offsets = tuple(tuple(i * lshape[d] if d == dim else 0 for d in range(len(lshape))) for i in range(tp))
    return distributed.Block(local=local, global_shape=gshape, offsets=offsets, shapes=(lshape,) * tp)


# Transformer Engine's spec fuses the two norms into the linears that follow them; checkpoints
# store them under the local spec's names, so a TE model and a local one read each other's
_TE_NORMS = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
}


def storage_key(name: str) -> str:
    """The key a parameter is stored under: its name in megatron's local spec."""
    for te, local in _TE_NORMS.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def _entries(
    model: torch.nn.Module,
    layout: ModelLayout,
    optimizer: torch.optim.Optimizer | None,
    adapters_only: bool = False,
) -> tuple[dict[str, distributed.Block], dict[str, torch.Tensor], dict[str, ParamRule]]:
    """(blocks, plain tensors, rule by key) of the model and the optimizer's current state."""
    rules, params = _checked_rules(model, layout)
    if adapters_only:
        rules = [r for r in rules if r.adapter]
    blocks, plain, by_key = {}, {}, {}

    def add(key: str, rule: ParamRule, tensor: torch.Tensor) -> None:
        by_key[key] = rule
        block = _block(rule, layout, tensor) if tensor.dim() > 0 else None
        if block is None:
            plain[key] = tensor
        else:
            blocks[key] = block

    for rule in rules:
        param, key = params[rule.megatron], rule.stored_as or storage_key(rule.megatron)
        add(key, rule, param.data)
        if optimizer is not None:
            for state_key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    add(f"{OPTIMIZER}.{state_key}.{key}", rule, value)
    return blocks, plain, by_key


def _groups_hyperparameters(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    # JSON in a byte tensor: DCP would flatten a list of dicts into one entry per value, and it
    # stores any other object as a pickle
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        text = json.dumps(groups, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"optimizer hyperparameters must be JSON numbers, strings, lists ({exc})") from None
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).clone()


def _set_hyperparameters(optimizer: torch.optim.Optimizer, stored: torch.Tensor, folder: Path) -> None:
    groups = json.loads(bytes(stored.tolist()).decode())
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint {folder}: {HYPERPARAMETERS} holds not one entry per parameter group")
    for group, hyper in zip(optimizer.param_groups, groups, strict=True):
        # JSON has no tuples: a value that is a tuple here (AdamW's betas) stays one
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in hyper.items()})


# ---- save / load ----


def _split(optimizer: object) -> tuple[torch.optim.Optimizer | None, MegatronOptimizer | None]:
    """(a torch optimizer, a megatron one): at most one is not None."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, None
    from megatron.core.optimizer import MegatronOptimizer

    if not isinstance(optimizer, MegatronOptimizer):
        raise ValueError(
            f"optimizer must be a torch optimizer or a MegatronOptimizer, got {type(optimizer).__name__}"
        )
    return None, optimizer


def save(
    folder: str | Path,
    model: GPTModel,
    layout: ModelLayout,
    optimizer: torch.optim.Optimizer | MegatronOptimizer | None = None,
    *,
    adapters_only: bool = False,
) -> Path:
    """Write the bare GPTModel (and the optimizer's state) under `folder`; collective over the world.

    `optimizer`: a torch optimizer over `model.parameters()` (CPU path) or a MegatronOptimizer
    (GPU path), or None. `adapters_only`: the LoRA adapters alone (the frozen base is the run's
    `--model`); `load` then fills the adapters of a model whose base is already loaded.

    Every DP replica takes part; each block is written once. Returns `folder`.
    """
    folder = Path(folder)
    torch_optimizer, megatron_optimizer = _split(optimizer)
    blocks, plain, _ = _entries(model, layout, torch_optimizer, adapters_only)
    if adapters_only and not blocks and not plain:
        raise ValueError("save(adapters_only=True): the model has no LoRA adapters")
    objects: dict = {}
    if torch_optimizer is not None:
        objects[HYPERPARAMETERS] = _groups_hyperparameters(torch_optimizer)
    if distributed.rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    distributed.save_sharded(folder / WEIGHTS, blocks, {**plain, **objects}, distributed.megatron_tp_group())
    if distributed.rank() == 0:
        marker = {
            "format": FORMAT,
            "family": layout.family,
            "num_layers": layout.num_layers,
            "hidden_size": layout.hidden_size,
            "vocab_size": layout.vocab_size,
            "saved_tp_size": layout.tp_size,
            "dtype": str(model.embedding.word_embeddings.weight.dtype).removeprefix("torch."),
            "optimizer": None if optimizer is None else ("megatron" if megatron_optimizer else "torch"),
            "adapters_only": adapters_only,
        }
        lora = state_of(model)
        if adapters_only and lora is not None:  # what `weights.megatron_to_hf` rebuilds them with
            marker["lora"] = dataclasses.asdict(lora.options)
        (folder / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True))
    if megatron_optimizer is not None:
        _save_megatron_optimizer(folder, model, megatron_optimizer)
    distributed.barrier()
    return folder


# ---- megatron's optimizers (GPU path): megatron's own sharded state, through dist_checkpointing ----


def _save_megatron_optimizer(folder: Path, model: GPTModel, optimizer: MegatronOptimizer) -> None:
    """A MegatronOptimizer's state (fp32 main weights, Adam moments; sharded over DP by the
    distributed optimizer) in megatron's dist_checkpointing format under `folder/optimizer/`.

    Its sharded state dict is built against the model's own `sharded_state_dict`, which
    megatron reshards across TP and DP on load. CUDA only (megatron's writer synchronises
    the device); the GPU check exercises it.
    """
    from megatron.core import dist_checkpointing

    target = folder / OPTIMIZER
    if distributed.rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    dist_checkpointing.save(optimizer.sharded_state_dict(model.sharded_state_dict()), str(target))


def _load_megatron_optimizer(folder: Path, model: GPTModel, optimizer: MegatronOptimizer) -> None:
    from megatron.core import dist_checkpointing

    target = folder / OPTIMIZER
    if not target.is_dir():
        raise ValueError(f"checkpoint {folder} holds no megatron optimizer state (no {OPTIMIZER}/)")
    # megatron's own DCP reader unpickles the metadata and byte entries freely: checked first
    safe_load.check_dcp(target)
    request = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True)
    optimizer.load_state_dict(dist_checkpointing.load(request, str(target)))


def saved_tensors(folder: str | Path) -> dict[str, tuple[int, ...] | None]:
    """Full shape of every tensor in the checkpoint at `folder` (None: a stored object)."""
    read_marker(folder)
    return distributed.saved_shapes(Path(folder) / WEIGHTS)


@torch.no_grad()
def load(
    folder: str | Path,
    model: GPTModel,
    layout: ModelLayout,
    optimizer: torch.optim.Optimizer | MegatronOptimizer | None = None,
) -> None:
    """Fill the bare GPTModel (and the optimizer) from a checkpoint written at any TP; collective.

    The optimizer must be built over `model.parameters()`; its state is replaced by the saved
    one (the hyperparameters of its groups too). ValueError, naming the tensor, when the
    checkpoint holds another model or lacks the optimizer.
    """
    folder = Path(folder)
    saved = saved_tensors(folder)
    rules, params = _checked_rules(model, layout)
    adapters_only = bool(read_marker(folder).get("adapters_only"))
    if adapters_only:
        if not any(r.adapter for r in rules):
            raise ValueError(
                f"checkpoint {folder} holds LoRA adapters alone, and this model has none: load it with "
                "the same --lora-rank over its base model (--model), or export a merged model "
                "(--export-hf) from that run"
            )
        rules = [r for r in rules if r.adapter]
    optimizer, megatron_optimizer = _split(optimizer)
    if optimizer is not None:
        keys = {r.megatron: r.stored_as or storage_key(r.megatron) for r in rules}
        _prepare_state(optimizer, params, keys, saved, folder)
    blocks, plain, _ = _entries(model, layout, optimizer, adapters_only)
    expected = {k: b.global_shape for k, b in blocks.items()} | {k: tuple(t.shape) for k, t in plain.items()}
    for key, shape in expected.items():
        if key not in saved:
            raise ValueError(f"checkpoint {folder} has no tensor {key!r} (another model or layout?)")
        if saved[key] != shape:
            raise ValueError(
                f"checkpoint {folder}: tensor {key!r} has shape {saved[key]}, this model expects {shape}"
            )
    objects = {}
    if optimizer is not None:
        size = saved[HYPERPARAMETERS]
        if size is None:
            raise ValueError(f"checkpoint {folder}: {HYPERPARAMETERS} is not a tensor")
        objects[HYPERPARAMETERS] = torch.zeros(size, dtype=torch.uint8)
    loaded = distributed.load_sharded(
        folder / WEIGHTS, blocks, {**plain, **objects}, distributed.megatron_tp_group()
    )
    _zero_vocab_padding(model, layout)
    if optimizer is not None:
        hyperparameters = loaded[HYPERPARAMETERS]
        assert isinstance(hyperparameters, torch.Tensor), "filled in place: the zeros passed above"
        _set_hyperparameters(optimizer, hyperparameters, folder)
    if megatron_optimizer is not None:
        # after the model: megatron's optimizer copies its fp32 main weights from the state
        _load_megatron_optimizer(folder, model, megatron_optimizer)


def _prepare_state(
    optimizer: torch.optim.Optimizer, params: dict, keys: dict[str, str], saved: dict, folder: Path
) -> None:
    """Give every parameter the state tensors the checkpoint holds, so DCP can load into them."""
    prefix = f"{OPTIMIZER}."
    names = {id(p): keys[n] for n, p in params.items() if n in keys}
    if _PICKLED_HYPERPARAMETERS in saved and HYPERPARAMETERS not in saved:
        raise ValueError(
            f"checkpoint {folder} stores its optimizer hyperparameters as a pickle (an earlier format), "
            "which is not read: load it as --model (weights only) and train from there"
        )
    if HYPERPARAMETERS not in saved:
        raise ValueError(f"checkpoint {folder} holds no optimizer state (saved without an optimizer)")
    state_keys = sorted(
        {k[len(prefix) :].split(".", 1)[0] for k in saved if k.startswith(prefix)} - {"param_groups"}
    )
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a tensor that is not a parameter of the model")
            name = names[id(p)]
            state = {}
            for key in state_keys:
                shape = saved.get(f"{prefix}{key}.{name}")
                if shape is None:
                    continue
                # scalars (AdamW's step) are float32 on the CPU, as torch's optimizers keep them
                state[key] = torch.zeros((), dtype=torch.float32) if shape == () else torch.zeros_like(p)
            optimizer.state[p] = state


def _zero_vocab_padding(model: torch.nn.Module, layout: ModelLayout) -> None:
    # rows past the true vocabulary are not stored; they stay zero, as the HF import makes them
    start = distributed.rank(distributed.megatron_tp_group()) * layout.vocab_per_rank
    real = max(0, min(layout.vocab_per_rank, layout.vocab_size - start))
    if real == layout.vocab_per_rank:
        return
    params = dict(model.named_parameters())
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in params:
            params[name].data[real:] = 0


# ---- full tensors, for checks ----


@torch.no_grad()
def full_tensors(
    model: torch.nn.Module, layout: ModelLayout, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, torch.Tensor]:
    """Every stored tensor joined into its TP=1 layout (vocabulary padding cut); collective over TP.

    Two runs at different TP sizes hold the same model exactly when these dicts are equal.
    """
    blocks, plain, by_key = _entries(model, layout, optimizer)
    group = distributed.megatron_tp_group()
    out = {k: t.detach().clone() for k, t in plain.items()}
    for key, block in blocks.items():
        rule = by_key[key]
        local = _unview(block.local) if rule.split == "glu_rows" else block.local
        full = _join(rule, distributed.all_gather_tensor(_padded(local, rule, layout), group))
        out[key] = full[: layout.vocab_size] if rule.fuse == "vocab" else full
    return out


def _unview(local: torch.Tensor) -> torch.Tensor:
    return local.reshape(-1, *local.shape[2:])  # [2, F / tp, h] -> [2F / tp, h]


def _padded(local: torch.Tensor, rule: ParamRule, layout: ModelLayout) -> torch.Tensor:
    # all_gather needs equal shapes: the last vocabulary block is padded back to vocab_per_rank
    if rule.fuse != "vocab" or local.shape[0] == layout.vocab_per_rank:
        return local
    pad = local.new_zeros((layout.vocab_per_rank - local.shape[0], *local.shape[1:]))
    return torch.cat([local, pad])
