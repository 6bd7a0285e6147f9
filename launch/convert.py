"""Convert between an HF folder and a sharded megatron checkpoint, without training.

    torchrun --nproc_per_node=2 launch/convert.py --hf IN_DIR --megatron OUT_DIR --tp 2
    torchrun --nproc_per_node=1 launch/convert.py --megatron IN_DIR --hf OUT_DIR
    torchrun --nproc_per_node=1 launch/convert.py --megatron RUN/checkpoints/step-N --base MODEL --hf OUT_DIR

The input is whichever of the two folders exists; the output must not exist (or be empty).
A checkpoint written at one TP size converts back at any other. Every tensor survives the
round trip bit for bit. A `--lora-rank` run's checkpoint holds its adapters alone: --base names
the model they adapt, and the output is the merged model (W + alpha / r * B A). --tp defaults to
the number of processes. The output is written to a temporary folder and renamed when complete;
a megatron output carries `manifest.json` (size and sha256 of every file) and `meta.json` (where
it came from), as the trainers' checkpoints do; the manifest is checked before a megatron input
is read.
Bad input: one line on stderr naming the flag, exit code 2, nothing written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PROG = "convert.py"


class UsageError(ValueError):
    """A bad flag; the message is one line that names it."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors, as one line like ours
        raise UsageError(message)


@dataclass(frozen=True, kw_only=True)
class Conversion:
    direction: Literal["hf_to_megatron", "megatron_to_hf"]
    source: Path
    target: Path
    tp: int
    base: Path | None = None  # the model a checkpoint of LoRA adapters adapts


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _is_empty_or_absent(path: Path) -> bool:
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def parse(argv: list[str] | None) -> Conversion:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--hf", type=Path, required=True, help="HF folder (config, tokenizer, safetensors)")
    parser.add_argument("--megatron", type=Path, required=True, help="sharded megatron checkpoint folder")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: all processes)")
    parser.add_argument(
        "--base",
        type=Path,
        default=None,
        help="with --megatron holding LoRA adapters alone (a --lora-rank run's checkpoint): the model "
        "they adapt (HF folder or checkpoint); --hf then gets the merged model",
    )
    args = parser.parse_args(argv)
    tp = _world_size() if args.tp is None else args.tp
    if tp < 1 or _world_size() % tp:
        raise UsageError(f"--tp {tp} does not divide the number of processes {_world_size()}")
    hf_in, mg_in = not _is_empty_or_absent(args.hf), not _is_empty_or_absent(args.megatron)
    if hf_in and mg_in:
        raise UsageError(
            f"--hf {args.hf} and --megatron {args.megatron} both hold files; one must be the output"
        )
    if not hf_in and not mg_in:
        raise UsageError(
            f"--hf {args.hf} and --megatron {args.megatron}: neither exists, so there is no input"
        )
    if hf_in:
        conv = Conversion(direction="hf_to_megatron", source=args.hf, target=args.megatron, tp=tp)
        _check_hf(conv.source)
    else:
        conv = Conversion(
            direction="megatron_to_hf", source=args.megatron, target=args.hf, tp=tp, base=args.base
        )
        _check_megatron(conv.source)
        _check_base(conv)
    _check_heads(conv)
    if conv.target.exists() and not conv.target.is_dir():
        flag = "--megatron" if conv.direction == "hf_to_megatron" else "--hf"
        raise UsageError(f"{flag} {conv.target}: exists and is not a folder")
    return conv


def _check_hf(folder: Path) -> None:
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise UsageError(f"--hf {folder}: not an HF folder (no config.json)")
    if not any(folder.glob("*.safetensors")):
        raise UsageError(f"--hf {folder}: no *.safetensors weights")


def _check_megatron(folder: Path) -> None:
    from trainers.checkpoint import MANIFEST, verify

    if not (folder / "megatron.json").is_file() or not (folder / "weights").is_dir():
        raise UsageError(
            f"--megatron {folder}: not a sharded megatron checkpoint (no megatron.json and weights/)"
        )
    if not (folder / "config.json").is_file():
        raise UsageError(f"--megatron {folder}: no config.json (the HF config is kept next to the weights)")
    # a trainer's checkpoint folder and this script's output both carry a manifest
    if (folder / MANIFEST).is_file() and (reason := verify(folder)):
        raise UsageError(f"--megatron {folder}: corrupt checkpoint ({reason})")


def _check_base(conv: Conversion) -> None:
    adapters_only = bool(json.loads((conv.source / "megatron.json").read_text()).get("adapters_only"))
    if adapters_only and conv.base is None:
        raise UsageError(
            f"--megatron {conv.source} holds LoRA adapters alone: add --base MODEL, the model they adapt "
            "(the run's --model)"
        )
    if not adapters_only and conv.base is not None:
        raise UsageError(
            f"--base {conv.base}: --megatron {conv.source} holds a whole model, not LoRA adapters"
        )
    if conv.base is not None and not (conv.base / "config.json").is_file():
        raise UsageError(f"--base {conv.base}: not an HF folder or a checkpoint (no config.json)")


def _check_heads(conv: Conversion) -> None:
    config = json.loads((conv.source / "config.json").read_text())
    flag = "--hf" if conv.direction == "hf_to_megatron" else "--megatron"
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = config.get(key) or config.get("num_attention_heads")
        if not isinstance(n, int) or n % conv.tp:
            raise UsageError(f"--tp {conv.tp} does not divide {key}={n} of the model in {flag} {conv.source}")


def convert(conv: Conversion) -> Path:
    """Collective: write `conv.target` from `conv.source` (through a temporary folder)."""
    from interlens_mcore import distributed
    from interlens_mcore.megatron import hf_to_megatron, megatron_to_hf

    tmp = conv.target.parent / f".{conv.target.name}.tmp"
    if distributed.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    if conv.direction == "hf_to_megatron":
        hf_to_megatron(conv.source, tmp)
    else:
        megatron_to_hf(conv.source, tmp, base=conv.base)
    if distributed.rank() == 0:
        if conv.direction == "hf_to_megatron":
            from trainers.checkpoint import META, write_manifest

            meta = {"converted_from": str(conv.source.resolve()), "tp": conv.tp}
            (tmp / META).write_text(json.dumps(meta, indent=1))
            write_manifest(tmp)
        if conv.target.exists():
            conv.target.rmdir()  # empty, as parse() checked
        os.replace(tmp, conv.target)
    distributed.barrier()
    return conv.target


def main(argv: list[str] | None = None) -> int:
    try:
        conv = parse(argv)
    except UsageError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    import torch

    from interlens_mcore import distributed

    torch.set_num_threads(1)  # ranks share the cores
    distributed.init_distributed()
    try:
        distributed.init_megatron(conv.tp)
        out = convert(conv)
        if distributed.rank() == 0:
            print(f"{PROG}: wrote {out} ({conv.direction}, TP={conv.tp})", file=sys.stderr)
    finally:
        distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
