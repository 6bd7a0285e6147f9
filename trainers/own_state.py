"""The trainer's own part of a checkpoint: its step, skipped steps, random generators and, with
--kl-in-reward, the reward's KL coefficient.

Each rank writes `trainer-rankNNNNN.json` (step, skipped steps, Python's and NumPy's generator
states as lists of integers, the KL coefficient) and `trainer-rankNNNNN.safetensors` (torch's
generator state, a uint8 tensor). Neither format can carry code, unlike the pickle `torch.save`
writes: a checkpoint is shared between people, and resuming from one must not run anything it holds.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FORMAT = "interlens_mcore.trainer_state/1"


def json_name(rank: int) -> str:
    return f"trainer-rank{rank:05d}.json"


def tensors_name(rank: int) -> str:
    return f"trainer-rank{rank:05d}.safetensors"


@dataclass(frozen=True)
class TrainerState:
    """One rank's loop position and generator states, as stored."""

    step: int
    skipped_steps: int
    python_rng: list  # random.getstate() with its tuples as lists
    numpy_rng: list  # np.random.get_state(): [name, 624 keys, pos, has_gauss, cached_gaussian]
    torch_rng: torch.Tensor  # [5056] uint8, torch.get_rng_state()
    kl_coef: float | None = None  # --kl-in-reward: the coefficient the next step uses
    sft_step: int = 0  # --sft-data: supervised steps done (a resumed run neither redoes nor skips them)

    @classmethod
    def capture(
        cls, *, step: int, skipped_steps: int, kl_coef: float | None = None, sft_step: int = 0
    ) -> TrainerState:
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state()
        return cls(
            step=step,
            skipped_steps=skipped_steps,
            python_rng=[version, list(internal), gauss],
            numpy_rng=[name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
            torch_rng=torch.get_rng_state(),
            kl_coef=kl_coef,
            sft_step=sft_step,
        )

    def restore(self) -> None:
        """Put every generator back where it was when captured."""
        version, internal, gauss = self.python_rng
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = self.numpy_rng
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(self.torch_rng)

    def write(self, folder: Path, rank: int) -> None:
        from safetensors.torch import save_file

        data = {
            "format": FORMAT,
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "python_rng": self.python_rng,
            "numpy_rng": self.numpy_rng,
            **({} if self.kl_coef is None else {"kl_coef": self.kl_coef}),
            "sft_step": self.sft_step,
        }
        (folder / json_name(rank)).write_text(json.dumps(data))
        save_file({"torch_rng": self.torch_rng.contiguous()}, str(folder / tensors_name(rank)))


def read(folder: Path, rank: int) -> TrainerState:
    """Rank `rank`'s state in `folder`; ValueError naming the file when it is not what `write` wrote."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / json_name(rank)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a trainer state of format {FORMAT}")
    tensors_path = folder / tensors_name(rank)
    try:
        torch_rng = load_file(str(tensors_path))["torch_rng"]
    except (OSError, KeyError, SafetensorError) as exc:
        raise ValueError(f"{tensors_path}: unreadable ({type(exc).__name__}: {exc})") from None
    reason = _malformed(data, torch_rng)
    if reason is not None:
        raise ValueError(f"{path}: {reason}")
    return TrainerState(
        step=data["step"],
        skipped_steps=data["skipped_steps"],
        python_rng=data["python_rng"],
        numpy_rng=data["numpy_rng"],
        torch_rng=torch_rng,
        kl_coef=data.get("kl_coef"),
        sft_step=data.get("sft_step", 0),
    )


def _malformed(data: dict, torch_rng: torch.Tensor) -> str | None:
    """Why the stored fields are not a trainer state, or None."""

    def ints(xs: object, n: int) -> bool:
        return isinstance(xs, list) and len(xs) == n and all(type(x) is int for x in xs)

    for name in ("step", "skipped_steps", "sft_step"):
        value = data.get(name, 0)
        if type(value) is not int or value < 0:
            return f"{name} must be an integer >= 0, got {value!r}"
    py = data.get("python_rng")
    if not (isinstance(py, list) and len(py) == 3 and ints(py[1], 625) and isinstance(py[2], float | None)):
        return "python_rng is not the state of Python's generator"
    n = data.get("numpy_rng")
    if not (isinstance(n, list) and len(n) == 5 and n[0] == "MT19937" and ints(n[1], 624)):
        return "numpy_rng is not the state of NumPy's MT19937 generator"
    if torch_rng.dtype != torch.uint8 or torch_rng.dim() != 1:
        return "torch_rng is not a uint8 vector"
    coef = data.get("kl_coef")
    if coef is not None and not (type(coef) is float and 0 < coef < float("inf")):
        return f"kl_coef must be a finite number > 0, got {coef!r}"
    return None
