"""`Backend`: what the GRPO loop needs from a training framework, and `build_backend` for ours.

Two backends ship: `MegatronBackend` (megatron-core GPTModel, TP x DP, packed THD batches) and
`DeepSpeedBackend` (an HF model under ZeRO 1/2/3, padded batches). A backend of your own is any
object with these members::

    class MyBackend:
        engine = HFEngine(model, tokenizer)     # generates with the weights being trained
        layout, pad_to_multiple = "padded", 1   # how the loop builds TrainingBatches for it
        micro_batches = None                    # or the exact count a step must have
        has_reference = False                   # a frozen reference model for the KL term?

        def logprobs_of(self, batch, *, reference=False): ...  # [B, T], with grad for the policy
        def backward(self, loss): ...
        def optimizer_step(self) -> float: ...  # global grad norm; skip the update if not finite
        def save(self, folder): ...
        def load(self, folder): ...
        def export_hf(self, out_dir): ...
        def frozen_engine(self): ...            # the initial weights, for frozen opponent seats
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

import torch

from interlens_mcore import parallel
from interlens_mcore.batch import TrainingBatch
from interlens_mcore.engine import Engine

from .config import BackendConfig, TrainerConfig


class Backend(Protocol):
    engine: Engine
    layout: str
    pad_to_multiple: int
    micro_batches: int | None
    has_reference: bool

    def logprobs_of(self, batch: TrainingBatch, *, reference: bool = False) -> torch.Tensor:
        """[B, T] logprobs of batch.targets: the trained model's (with gradient) or the reference's."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def optimizer_step(self) -> float:
        """Clip, step, zero the gradients; returns the global gradient norm (collective).

        The norm is over the whole model: every TP shard, after the DP average. When it is not
        finite (NaN or inf) the step is NOT applied: the gradients are zeroed, weights and
        optimizer state stay untouched, and the norm is returned as is so the caller counts the
        skip. Every rank must reach the same decision, which holds because every rank returns
        the same global norm.
        """

    def save(self, folder: Path) -> None:
        """Write model and optimizer state of this rank into `folder` (collective)."""

    def load(self, folder: Path) -> None: ...

    def export_hf(self, out_dir: str | Path) -> Path: ...

    def frozen_engine(self) -> Engine: ...


def build_backend(
    cfg: BackendConfig,
    trainer: TrainerConfig,
    *,
    model_path: Path,
    tokenizer: Any,
    temperature: float,
    reference: bool,
    trajectories_per_rank: int,
    micro_batch_size: int,
) -> tuple[Backend, parallel.ParallelGroups]:
    """Collective: the process groups and the backend `cfg.backend` names.

    `trajectories_per_rank` (samples x trained seats) fixes DeepSpeed's accumulation steps.
    """
    if cfg.backend == "megatron":
        from .megatron_backend import MegatronBackend

        parallel.init_megatron(cfg.tp)
        groups = parallel.build_groups(rollout="model_parallel")
        backend = MegatronBackend(
            model_path=model_path,
            groups=groups,
            lr=trainer.lr,
            weight_decay=trainer.weight_decay,
            grad_clip=trainer.grad_clip,
            temperature=temperature,
            reference=reference,
            tokenizer=tokenizer,
        )
        return backend, groups
    from .deepspeed_backend import DeepSpeedBackend, deepspeed_config

    # ZeRO-3 gathers parameters in every forward: generation is collective over the DP group
    groups = parallel.build_groups(rollout="data_parallel" if cfg.zero_stage == 3 else "model_parallel")
    micro = math.ceil(trajectories_per_rank / micro_batch_size) if micro_batch_size else 1
    ds = deepspeed_config(
        zero_stage=cfg.zero_stage,
        lr=trainer.lr,
        weight_decay=trainer.weight_decay,
        grad_clip=trainer.grad_clip,
        micro_batches=micro,
    )
    backend = DeepSpeedBackend(
        model_path=model_path,
        ds_config=ds,
        groups=groups,
        tokenizer=tokenizer,
        temperature=temperature,
        reference=reference,
    )
    return backend, groups
