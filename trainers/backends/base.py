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
        def sync_engine_weights(self) -> float: ...  # after the optimizer steps; seconds taken

Both backends take `vllm=VLLMConfig(...)` (`--engine vllm`): `engine` is then a `VLLMEngine`
colocated in the training ranks on the rollout group, and `sync_engine_weights` hands it the
trained weights from memory. With their own engine (`--engine native`) it does nothing.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from interlens_mcore import parallel
from interlens_mcore.batch import TrainingBatch
from interlens_mcore.engine import Engine
from interlens_mcore.vllm_engine import VLLMConfig

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

    def sync_engine_weights(self) -> float:
        """Give the generating engine the trained weights; returns the seconds it took (collective).

        Every rank calls it at the same point, after the optimizer steps of a rollout. An engine
        that generates with the trained model itself needs nothing: 0.0.
        """


class ColocatedVLLM:
    """A backend's `VLLMEngine` and what it needs around it: weight syncs, sleep during training.

    With `VLLMConfig.enable_sleep` (GPU) vLLM frees its memory at the first training forward
    after a rollout (`idle`) and takes it back before the next weight sync.
    """

    def __init__(self, model_path: Path, config: VLLMConfig, *, group: Any, tensors: Callable[[], Iterable]):
        from interlens_mcore.vllm_engine import VLLMEngine

        # a sharded megatron checkpoint has no HF weights for vLLM to read: start from random
        # ones and sync the real ones at once
        megatron = (Path(model_path) / "megatron.json").is_file()
        if megatron:
            config = dataclasses.replace(config, extra={**config.extra, "load_format": "dummy"})
        self.engine = VLLMEngine.create(str(model_path), config, group=group)
        self.tensors, self.sleep, self.asleep = tensors, config.enable_sleep, False
        if megatron:
            self.sync()

    def idle(self) -> None:
        if self.sleep and not self.asleep:
            self.engine.release()
            self.asleep = True

    def sync(self) -> float:
        t0 = time.perf_counter()
        if self.asleep:
            self.engine.resume()
            self.asleep = False
        self.engine.update_weights(self.tensors())
        return time.perf_counter() - t0


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

    def vllm(tp: int) -> VLLMConfig | None:
        if cfg.engine == "native":
            return None
        return VLLMConfig(
            tensor_parallel_size=tp,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            enable_sleep=cfg.vllm_sleep,
        )

    if cfg.backend == "megatron":
        from .megatron_backend import MegatronBackend

        parallel.init_megatron(cfg.tp, timeout_s=trainer.collective_timeout_s)
        groups = parallel.build_groups(rollout="model_parallel", vote_timeout_s=trainer.collective_timeout_s)
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
    from .deepspeed_backend import DeepSpeedBackend, deepspeed_config

    # ZeRO-3 gathers parameters in every forward: HFEngine's generation is collective over the DP
    # group. vLLM (TP=1 on each rank) holds whole weights of its own and generates alone
    lockstep = cfg.zero_stage == 3 and cfg.engine == "native"
    groups = parallel.build_groups(
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
