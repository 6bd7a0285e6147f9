"""`Backend`: what the GRPO loop needs from a training framework (`factory.build_backend` builds ours).

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
        def set_lr(self, lr): ...               # the learning rate of the next optimizer steps
        def save(self, folder): ...
        def load(self, folder): ...
        def export_hf(self, out_dir): ...
        def frozen_engine(self): ...            # the initial weights, for frozen opponent seats
        def sync_engine_weights(self) -> float: ...  # after the optimizer steps; seconds taken
        def close(self): ...                    # the run's last call: a colocated vLLM shut down

Both backends take `vllm=VLLMConfig(...)` (`--engine vllm`): `engine` is then a `VLLMEngine`
colocated in the training ranks on the rollout group, and `sync_engine_weights` hands it the
trained weights from memory. With their own engine (`--engine native`) it does nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from interlens_mcore.distributed import ParallelGroups
from interlens_mcore.engines.base import Engine
from interlens_mcore.grpo.batch import Layout, TrainingBatch

from ..config import BackendConfig, TrainerConfig

REFERENCE_DIR = "reference"  # a checkpoint's moved KL reference (--sync-ref-model), beside the policy
ADAPTER_DIR = "adapter"  # a LoRA checkpoint's adapters in peft's layout


class Backend(Protocol):
    engine: Engine

    # read-only: a backend may fix them as class attributes or compute them
    @property
    def layout(self) -> Layout: ...

    @property
    def pad_to_multiple(self) -> int: ...

    @property
    def micro_batches(self) -> int | None: ...

    @property
    def has_reference(self) -> bool: ...

    def logprobs_of(self, batch: TrainingBatch, *, reference: bool = False) -> torch.Tensor:
        """[B, T] logprobs of batch.targets: the trained model's (with gradient) or the reference's.

        A backend may also set `token_entropy` [B, T] on a policy forward: the entropy of the
        policy at each position, which the step logs as `entropy`, without gradient unless the
        step has set `entropy_grad = True` (an entropy bonus, `--entropy-coeff`) and the forward
        runs with gradient enabled."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def optimizer_step(self) -> float:
        """Clip, step, zero the gradients; returns the global gradient norm (collective).

        The norm is over the whole model: every TP shard, after the DP average. When it is not
        finite (NaN or inf) the step is NOT applied: the gradients are zeroed, weights and
        optimizer state stay untouched, and the norm is returned as is so the caller counts the
        skip. Every rank must reach the same decision, which holds because every rank returns
        the same global norm.
        """

    def set_lr(self, lr: float) -> None:
        """The learning rate of the optimizer steps that follow (the loop sets it every step)."""

    def save(self, folder: Path) -> None:
        """Write model and optimizer state of this rank into `folder` (collective)."""

    def load(self, folder: Path) -> None: ...

    def export_hf(self, out_dir: str | Path) -> Path: ...

    def frozen_engine(self) -> Engine: ...

    def close(self) -> None:
        """Release what must go before the process groups do: a colocated vLLM, whose shutdown
        destroys torch's default process group. The run's last call, after the last collective."""

    def sync_engine_weights(self) -> float:
        """Give the generating engine the trained weights; returns the seconds it took (collective).

        Every rank calls it at the same point, after the optimizer steps of a rollout. An engine
        that generates with the trained model itself needs nothing: 0.0.
        """


class BackendBuilder(Protocol):
    """The `build` function of a backend's module (`registry.BACKENDS` names the module).

    Collective: makes the process groups the backend trains on (after any framework setup
    they need) and the backend. `trajectories_per_rank` is samples x trained seats per step,
    `micro_batch_size` the trajectories of one micro-batch (0: one micro-batch).
    """

    def __call__(
        self,
        cfg: BackendConfig,
        trainer: TrainerConfig,
        *,
        model_path: Path,
        tokenizer: PreTrainedTokenizerBase,
        temperature: float,
        reference: bool,
        trajectories_per_rank: int,
        micro_batch_size: int,
    ) -> tuple[Backend, ParallelGroups]: ...
