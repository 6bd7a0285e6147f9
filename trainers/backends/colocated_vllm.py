"""A backend's colocated vLLM engine and its weight syncs (`--engine vllm`), shared by both backends."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from interlens_mcore.engines.vllm import VLLMConfig

from ..config import BackendConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class ColocatedVLLM:
    """A backend's `VLLMEngine` and what it needs around it: weight syncs, sleep during training.

    With `VLLMConfig.enable_sleep` (GPU) vLLM frees its memory at the first training forward
    after a rollout (`idle`) and takes it back before the next weight sync.

    `tensors` yields the HF weights a sync streams into vLLM. With `adapter` (LoRA through vLLM's
    LoRA path) a sync instead calls `adapter(folder)`, which writes this rank's whole adapters in
    peft's layout (collective where gathering them is), and vLLM loads them; `tensors` then yields
    the base weights, streamed once at start when vLLM begins from random ones.
    """

    def __init__(
        self,
        model_path: Path,
        config: VLLMConfig,
        *,
        group: ProcessGroup | None,
        tensors: Callable[[], Iterable],
        adapter: Callable[[Path], object] | None = None,
    ):
        from interlens_mcore.engines.vllm import VLLMEngine

        # a sharded megatron checkpoint has no HF weights for vLLM to read: start from random
        # ones and sync the real ones at once
        megatron = (Path(model_path) / "megatron.json").is_file()
        if megatron:
            config = dataclasses.replace(config, extra={**config.extra, "load_format": "dummy"})
        self.engine = VLLMEngine.create(str(model_path), config, group=group)
        self.tensors, self.sleep, self.asleep = tensors, config.enable_sleep, False
        self.adapter = adapter
        # this rank's adapter folders (vLLM reads each once, in load_adapter)
        self.scratch = Path(tempfile.mkdtemp(prefix="interlens-vllm-adapter-")) if adapter else None
        if megatron:
            self.engine.update_weights(self.tensors())
        if megatron or adapter is not None:
            self.sync()

    def idle(self) -> None:
        if self.sleep and not self.asleep:
            self.engine.release()
            self.asleep = True

    def close(self) -> None:
        """vLLM shut down (it destroys torch's default process group: the run's last step)."""
        self.engine.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def sync(self) -> float:
        t0 = time.perf_counter()
        if self.asleep:
            self.engine.resume()
            self.asleep = False
        if self.adapter is None:
            self.engine.update_weights(self.tensors())
        else:
            assert self.scratch is not None
            folder = self.scratch / f"sync-{len(self.engine.syncs)}"
            self.adapter(folder)
            self.engine.load_adapter(folder)
            shutil.rmtree(folder, ignore_errors=True)
        return time.perf_counter() - t0


def vllm_config(cfg: BackendConfig, tp: int) -> VLLMConfig | None:
    """The colocated vLLM `cfg` asks for (`--engine vllm`) at TP size `tp`, or None (native)."""
    if cfg.engine == "native":
        return None
    # vLLM's own "auto" is the checkpoint's dtype, often bfloat16 where the trainer computes in
    # float32: then every rollout logprob differs from the trainer's, and IS corrects noise
    trainer = "bfloat16" if cfg.bf16 else "float32"
    return VLLMConfig(
        tensor_parallel_size=tp,
        dtype=trainer if cfg.vllm_dtype == "auto" else cfg.vllm_dtype,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        enable_sleep=cfg.vllm_sleep,
        max_lora_rank=cfg.lora_rank if lora_sync(cfg) == "adapter" else 0,
    )


def lora_sync(cfg: BackendConfig) -> str | None:
    """How LoRA adapters reach the colocated vLLM (--vllm-lora): "merged" or "adapter"; None
    without LoRA or vLLM. auto: merged on megatron (vLLM then runs the plain model), adapter on
    deepspeed (peft's model gives no merged stream)."""
    if not cfg.lora_rank or cfg.engine == "native":
        return None
    if cfg.vllm_lora != "auto":
        return cfg.vllm_lora
    return "merged" if cfg.backend == "megatron" else "adapter"
