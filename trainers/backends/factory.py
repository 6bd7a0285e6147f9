"""`build_backend`: the process groups and the backend a `BackendConfig` names.

The names and their modules are `registry.BACKENDS`; each module's `build` (a
`base.BackendBuilder`) is imported when its name is asked for, not before.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from interlens_mcore import distributed

from ..config import BackendConfig, TrainerConfig
from .base import Backend, BackendBuilder
from .registry import BACKENDS


def builder(name: str) -> BackendBuilder:
    """The `build` function of the backend registered as `name` (its module imported now)."""
    if name not in BACKENDS:
        raise ValueError(f"--backend {name!r}: expected one of {', '.join(BACKENDS)}")
    build: BackendBuilder = importlib.import_module(BACKENDS[name]).build
    return build


def build_backend(
    cfg: BackendConfig,
    trainer: TrainerConfig,
    *,
    model_path: Path,
    tokenizer: PreTrainedTokenizerBase,
    temperature: float,
    reference: bool,
    trajectories_per_rank: int,
    micro_batch_size: int,
) -> tuple[Backend, distributed.ParallelGroups]:
    """Collective: the process groups and the backend `cfg.backend` names.

    `trajectories_per_rank` (samples x trained seats) fixes DeepSpeed's accumulation steps.
    """
    return builder(cfg.backend)(
        cfg,
        trainer,
        model_path=model_path,
        tokenizer=tokenizer,
        temperature=temperature,
        reference=reference,
        trajectories_per_rank=trajectories_per_rank,
        micro_batch_size=micro_batch_size,
    )
