"""Where a GPTModel's weights come from: an HF folder or a sharded megatron checkpoint.

Both forms carry the HF config and tokenizer files, so `load_layout` and `AutoTokenizer`
read either; only the weights differ (`model.safetensors` vs `weights/`, see checkpoint.py).
Conversion builds the model at the current TP size and writes the other form, with no
training in between, so every tensor survives a round trip bit for bit (the model is built
in the dtype the weights are stored in).

Example (every rank of a torchrun world, parallel_state initialised at some TP)::

    hf_to_megatron("hf_folder", "megatron_folder")
    megatron_to_hf("megatron_folder", "hf_again")   # at this or any other TP size
    model, layout = load_model("either_folder")     # what a trainer's --model takes
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .. import distributed
from . import checkpoint, lora
from .convert import CHECKPOINT_FILES, WEIGHT_SUFFIXES, export_hf, load_hf_weights
from .model import ModelLayout, build_model, load_layout

is_megatron_checkpoint = checkpoint.is_megatron_checkpoint


def stored_dtype(path: str | Path) -> torch.dtype:
    """The dtype the folder's weights are stored in (its embedding's)."""
    path = Path(path)
    if is_megatron_checkpoint(path):
        name = checkpoint.read_marker(path)["dtype"]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(
                f"{path}: neither an HF folder with *.safetensors nor a sharded megatron checkpoint"
            )
        from safetensors import safe_open

        with safe_open(files[0], framework="pt") as f:
            key = next(iter(f.keys()))
            name = str(f.get_slice(key).get_dtype())
        name = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(name, name)
    return getattr(torch, name.removeprefix("torch."))


def load_weights(model: torch.nn.Module, layout: ModelLayout, path: str | Path) -> None:
    """This rank's shard of every weight, from an HF folder or a sharded checkpoint (collective)."""
    if is_megatron_checkpoint(path):
        checkpoint.load(path, model, layout)
    else:
        load_hf_weights(model, layout, path)


def load_model(path: str | Path, **build_kwargs) -> tuple[torch.nn.Module, ModelLayout]:
    """A GPTModel at megatron's current TP size with the weights of `path` (either form).

    `build_kwargs` go to `build_model` (e.g. params_dtype, config overrides).
    """
    layout = load_layout(path)
    model = build_model(layout, init_weights=False, **build_kwargs)
    load_weights(model, layout, path)
    return model, layout


def copy_hf_files(src: str | Path, out: str | Path) -> None:
    """Copy the HF config, generation config and tokenizer files of `src` into `out` (no weights).

    A sharded checkpoint that carries them is a complete model folder: `load_model`,
    `AutoTokenizer` and launch/convert.py take it as they take an HF folder.
    """
    src, out = Path(src), Path(out)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name not in CHECKPOINT_FILES:
            shutil.copy2(f, out / f.name)


def hf_to_megatron(hf_folder: str | Path, out_dir: str | Path) -> Path:
    """HF folder -> sharded megatron checkpoint at the current TP size; collective over the world.

    `out_dir` gets the HF config and tokenizer files next to `megatron.json` and `weights/`.
    """
    hf_folder, out = Path(hf_folder), Path(out_dir)
    model, layout = load_model(hf_folder, params_dtype=stored_dtype(hf_folder))
    checkpoint.save(out, model, layout)
    if distributed.rank() == 0:
        copy_hf_files(hf_folder, out)
    distributed.barrier()
    return out


def megatron_to_hf(
    megatron_folder: str | Path, out_dir: str | Path, *, base: str | Path | None = None
) -> Path:
    """Sharded megatron checkpoint (written at any TP) -> HF folder; collective over the world.

    A checkpoint of LoRA adapters alone (a `--lora-rank` run's) needs `base`, the model they
    adapt (an HF folder or a checkpoint): the output is the merged model, W + alpha / r * B A.
    """
    megatron_folder = Path(megatron_folder)
    marker = checkpoint.read_marker(megatron_folder)
    if not marker.get("adapters_only"):
        if base is not None:
            raise ValueError(f"{megatron_folder} holds a whole model, not LoRA adapters: it takes no base")
        dtype = stored_dtype(megatron_folder)
        model, layout = load_model(megatron_folder, params_dtype=dtype)
        # norms are float32 in megatron whatever params_dtype is: exact upcasts, cast back exactly
        return export_hf(model, layout, megatron_folder, out_dir, dtype=dtype)
    if base is None:
        raise ValueError(
            f"{megatron_folder} holds LoRA adapters alone: name the model they adapt (the run's --model)"
        )
    dtype = stored_dtype(base)
    model, layout = load_model(base, params_dtype=dtype)
    # float32 adapters, as the trainer's CPU path holds them: the merge is the one its export makes
    lora.attach(model, layout, lora.LoRAOptions(**_options(marker["lora"])), dtype=torch.float32)
    checkpoint.load(megatron_folder, model, layout)
    return export_hf(model, layout, megatron_folder, out_dir, dtype=dtype)


def _options(stored: dict) -> dict:
    # JSON has no tuples: a list of module names comes back as one
    names = stored["target_modules"]
    return {**stored, "target_modules": names if isinstance(names, str) else tuple(names)}


def hf_config(path: str | Path) -> dict:
    """The HF config.json of either form, as a dict (ValueError naming the folder if missing)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no config.json (expected an HF folder or a sharded megatron checkpoint)")
    return json.loads(file.read_text())
