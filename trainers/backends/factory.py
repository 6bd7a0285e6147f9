"""`build_backend`: the process groups and the backend a `BackendConfig` names (Megatron-core, DeepSpeed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from interlens_mcore import distributed
from interlens_mcore.engines.vllm import VLLMConfig

from ..config import BackendConfig, TrainerConfig
from .base import Backend


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
) -> tuple[Backend, distributed.ParallelGroups]:
    """Collective: the process groups and the backend `cfg.backend` names.

    `trajectories_per_rank` (samples x trained seats) fixes DeepSpeed's accumulation steps.
    """

    def vllm(tp: int) -> VLLMConfig | None:
        if cfg.engine == "native":
            return None
        return VLLMConfig(
            tensor_parallel_size=tp,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            enable_sleep=cfg.vllm_sleep,
        )

    if cfg.backend == "megatron":
        from .megatron import MegatronBackend

        distributed.init_megatron(cfg.tp, timeout_s=trainer.collective_timeout_s)
        groups = distributed.build_groups(
            rollout="model_parallel", vote_timeout_s=trainer.collective_timeout_s
        )
        backend = MegatronBackend(
            model_path=model_path,
            groups=groups,
            lr=trainer.lr,
            weight_decay=trainer.weight_decay,
            grad_clip=trainer.grad_clip,
            temperature=temperature,
            reference=reference,
            tokenizer=tokenizer,
            vllm=vllm(groups.tp_size),  # vLLM's TP group is the rollout group: the trainer's TP
            compute_dtype=torch.bfloat16 if cfg.bf16 else None,
        )
        return backend, groups
    from .deepspeed import DeepSpeedBackend, deepspeed_config

    # ZeRO-3 gathers parameters in every forward: HFEngine's generation is collective over the DP
    # group. vLLM (TP=1 on each rank) holds whole weights of its own and generates alone
    lockstep = cfg.zero_stage == 3 and cfg.engine == "native"
    groups = distributed.build_groups(
        rollout="data_parallel" if lockstep else "model_parallel", vote_timeout_s=trainer.collective_timeout_s
    )
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
        vllm=vllm(1),
    )
    return backend, groups
