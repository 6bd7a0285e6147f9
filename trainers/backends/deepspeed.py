"""`DeepSpeedBackend`: a `transformers` causal LM under DeepSpeed ZeRO stage 1, 2 or 3.

Placement: every rank is a DP replica (ZeRO shards optimizer state, gradients and, at stage
3, the parameters over the DP group). At stage 3 every forward gathers parameters across the
DP group, so generation is collective over it: the HF engine runs in lockstep mode
(`sync_group`) and the rollout vote covers the same group. Below stage 3 each rank generates
on its own, and so does a colocated vLLM (`vllm=VLLMConfig(...)`, TP=1 on every rank) at any
stage: it holds whole weights, which `sync_engine_weights` gathers into it after each step.

LoRA (`--lora-rank`, `lora=peft.LoraConfig(...)`): the model is wrapped by peft's
`get_peft_model`, only the adapters reach DeepSpeed's optimizer, and the KL reference is the same
module with its adapters switched off (`disable_adapter`): one model in memory, one extra forward.
Checkpoints then hold the adapters and their optimizer state alone (DeepSpeed's
`exclude_frozen_parameters`; the base weights are `--model`'s), and `adapter/` beside them in
peft's `save_pretrained` layout, which `PeftModel.from_pretrained(base, folder / "adapter")` loads.

Starting: DeepSpeed's communication init JIT-builds its `deepspeed_shm_comm` op into the shared
torch extensions folder, and a build killed midway leaves a `lock` file there on which every
later build of that op waits forever. Training never calls the op (it serves DeepSpeed
inference's `inference_all_reduce` only), so `start` marks it unavailable and nothing is built;
it names any build lock left in the extensions folder in one line, and a start still waiting
after a minute says where it waits (a build lock by its path).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch
from torch.utils.file_baton import FileBaton
from transformers import PreTrainedTokenizerBase

from interlens_mcore import distributed
from interlens_mcore.distributed.safe_load import check_checkpoint, weights_only_load
from interlens_mcore.engines.base import Engine
from interlens_mcore.engines.hf import HFEngine
from interlens_mcore.engines.prefix_cache import PrefixCachingEngine
from interlens_mcore.engines.vllm import VLLMConfig
from interlens_mcore.engines.weight_sync import hf_tensors, zero3_hf_tensors
from interlens_mcore.grpo.batch import Layout, TrainingBatch
from interlens_mcore.grpo.logprobs import token_entropy, token_logprobs

from ..config import BackendConfig, TrainerConfig, lora_targets
from .base import ADAPTER_DIR, REFERENCE_DIR
from .colocated_vllm import ColocatedVLLM, vllm_config

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import PreTrainedModel


def build(
    cfg: BackendConfig,
    trainer: TrainerConfig,
    *,
    model_path: Path,
    tokenizer: PreTrainedTokenizerBase,
    temperature: float,
    reference: bool,
    trajectories_per_rank: int,
    micro_batch_size: int,
) -> tuple[DeepSpeedBackend, distributed.ParallelGroups]:
    """`base.BackendBuilder` for `--backend deepspeed`: `trajectories_per_rank` fixes the accumulation."""
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
        vllm=vllm_config(cfg, 1),
        lora=lora_config(cfg),
        recompute=cfg.recompute,
    )
    return backend, groups


def lora_config(cfg: BackendConfig) -> LoraConfig | None:
    """peft's `LoraConfig` from the --lora-* options (None without --lora-rank)."""
    if not cfg.lora_rank:
        return None
    try:
        from peft import LoraConfig
    except ImportError:
        raise ValueError(
            "--lora-rank trains adapters with peft, which is not installed (pip install -e '.[lora]')"
        ) from None
    return LoraConfig(
        r=cfg.lora_rank,
        # peft types it int; it computes alpha / r in floats, so a fractional alpha works as given
        lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]
        lora_dropout=cfg.lora_dropout,
        target_modules=lora_targets(cfg.lora_target_modules),
        task_type="CAUSAL_LM",
    )


def deepspeed_config(
    *, zero_stage: int, lr: float, weight_decay: float, grad_clip: float, micro_batches: int
) -> dict:
    """The DeepSpeed JSON config the trainer uses by default (users may pass their own)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        # the trainer calls backward once per micro-batch and step() after each; DeepSpeed
        # applies the optimizer at the accumulation boundary
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": grad_clip,
        # persistence threshold 0: ZeRO-3 otherwise keeps small parameters gathered, and a gather
        # made inside the engine's inference_mode would leave inference tensors for backward
        "zero_optimization": {"stage": zero_stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {
            "type": "AdamW",
            # torch's AdamW: DeepSpeed's fused one needs CUDA
            "params": {"lr": lr, "weight_decay": weight_decay, "torch_adam": True},
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


SHM_OP = "deepspeed_shm_comm"
START_PATIENCE_S = 60.0


def start(model: torch.nn.Module, ds_config: dict) -> Any:
    """`deepspeed.initialize` without the shm op's JIT build; the engine (see the module docstring)."""
    import deepspeed
    import deepspeed.ops

    # read by DeepSpeed's TorchBackend before it builds the op (deepspeed/comm/torch.py, build_shm_op);
    # the dict is probed once and kept, so the edit holds
    deepspeed.ops.__compatible_ops__[SHM_OP] = False
    locks = build_locks()
    if locks and distributed.rank() == 0:
        print(
            f"deepspeed: build lock(s) {', '.join(map(str, locks))} in the torch extensions folder, left "
            "by a build that was killed unless one runs now: delete them (this start builds nothing, "
            "but any start that builds those ops waits on them forever)",
            file=sys.stderr,
            flush=True,
        )
    with said_if_slow("deepspeed.initialize", after_s=START_PATIENCE_S):
        # only what trains reaches the optimizer (all of it without LoRA, the adapters with it)
        trained = [p for p in model.parameters() if p.requires_grad]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trained, config=ds_config)
    return engine


def build_locks() -> list[Path]:
    """The `lock` files of torch extension builds (torch.utils.cpp_extension's FileBaton) under
    TORCH_EXTENSIONS_DIR, or the default build root (one folder per Python and device in it)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return sorted({p for pattern in ("*/lock", "*/*/lock") for p in root.glob(pattern)})


@contextmanager
def said_if_slow(what: str, *, after_s: float, out: IO[str] | None = None) -> Iterator[None]:
    """Run the block; if it has not ended after `after_s`, print once where this thread waits."""
    waiting = threading.get_ident()
    done = threading.Event()

    def report() -> None:
        if not done.wait(after_s):
            print(
                f"{what}: still waiting after {after_s:g} s, {where(waiting)}",
                file=out or sys.stderr,
                flush=True,
            )

    watcher = threading.Thread(target=report, name=f"watch {what}", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def where(thread_id: int) -> str:
    """What the thread waits on: a torch extension build lock by its path, else its innermost line."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "in a thread that has ended"
    inner = frame
    while frame is not None:
        baton = frame.f_locals.get("self") if frame.f_code.co_name == "wait" else None
        if isinstance(baton, FileBaton):  # cpp_extension waits here while another build holds the lock
            return (
                f"on the torch extension build lock {baton.lock_file_path}: if no build is running, "
                "a killed one left it; delete it"
            )
        frame = frame.f_back
    return f"at {inner.f_code.co_filename}:{inner.f_lineno} in {inner.f_code.co_name}"


class DeepSpeedBackend:
    """An HF model wrapped by `deepspeed.initialize` from a JSON config dict.

    `reference=True` keeps a frozen copy of the initial weights for the KL term; with `lora` the
    reference is the base model itself, adapters off (no copy).
    """

    layout: Layout = "padded"
    pad_to_multiple = 1

    def __init__(
        self,
        *,
        model_path: str | Path,
        ds_config: dict,
        groups: distributed.ParallelGroups,
        tokenizer: PreTrainedTokenizerBase,
        temperature: float = 1.0,
        reference: bool = False,
        vllm: VLLMConfig | None = None,
        lora: LoraConfig | None = None,
        recompute: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        self.groups, self.tokenizer, self.temperature = groups, tokenizer, temperature or 1.0
        # the policy's entropy at each position of its last forward (the `entropy` metric), no grad
        self.token_entropy: torch.Tensor | None = None
        self.entropy_grad = False  # set by the step when an entropy bonus needs the gradient
        self._frozen_engine: HFEngine | None = None  # a frozen opponent's: built on first use
        self.model_path = Path(model_path)
        self.zero_stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
        # a non-finite step is skipped by ZeRO's optimizers (see optimizer_step); without ZeRO,
        # or in bf16 with the check turned off, DeepSpeed would apply it
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"ds_config zero_optimization.stage must be 1, 2 or 3, got {self.zero_stage}")
        if self.zero_stage < 3 and ds_config.get("bf16", {}).get("check_grad_overflow") is False:
            raise ValueError(
                "ds_config bf16.check_grad_overflow must stay true at ZeRO stage 1 and 2: "
                "it is what skips a non-finite step there"
            )
        # DeepSpeed steps at its accumulation boundary: one backward per micro-batch must reach
        # it exactly, or gradients would leak into the next rollout's step
        self.micro_batches = int(ds_config.get("gradient_accumulation_steps", 1))
        model: Any = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        if recompute:  # transformers' checkpointing of each decoder layer, in training mode only
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = lora
        if lora is not None:
            if vllm is not None and vllm.max_lora_rank < lora.r:
                raise ValueError(
                    f"LoRA adapters of rank {lora.r} reach a colocated vLLM through its LoRA path: build it "
                    f"with VLLMConfig(max_lora_rank={lora.r}) (--vllm-lora adapter)"
                )
            from peft import get_peft_model

            model = get_peft_model(model, lora)
        # with LoRA the reference is the base model under the adapters: nothing more to load
        self.reference = self._initial_model() if reference and lora is None else None
        self._adapters_off_reference = reference and lora is not None
        self.reference_moved = False  # mix_reference moved it off the initial weights: it is saved
        self.ds = start(model, ds_config)
        self._skipped_seen = self.ds.skipped_steps
        self.colocated = None
        self.prefix_cache: PrefixCachingEngine | None = None
        if vllm is not None:
            if vllm.tensor_parallel_size != 1:
                raise ValueError(
                    f"VLLMConfig.tensor_parallel_size {vllm.tensor_parallel_size}: the deepspeed backend "
                    "colocates one vLLM of TP 1 on every rank"
                )
            gather = zero3_hf_tensors if self.zero_stage == 3 else hf_tensors
            self.colocated = ColocatedVLLM(
                self.model_path,
                vllm,
                group=None,
                tensors=lambda: gather(self.ds.module),
                # with LoRA the base weights vLLM loaded from --model never change: adapters alone
                adapter=(lambda folder: self._write_adapter(folder, every_rank=True)) if lora else None,
            )
            self.engine: Engine = self.colocated.engine
        else:
            # the lockstep flag is a CPU tensor: it rides the gloo vote group over the same ranks
            sync = groups.vote if self.zero_stage == 3 else None
            # the prefix cache keeps each conversation's keys/values between its turns (the same
            # tokens as HFEngine, a shorter prefill); it is cleared whenever the weights change
            self.prefix_cache = PrefixCachingEngine(self.ds.module, tokenizer, sync_group=sync)
            self.engine = self.prefix_cache

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self._adapters_off_reference

    def _initial_model(self) -> PreTrainedModel:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        return model.eval().requires_grad_(False)

    def frozen_engine(self) -> HFEngine:
        """The initial weights (the KL reference when there is one), generating as "frozen".

        A whole model on every rank, outside ZeRO: its forwards are not collective.
        """
        if self._frozen_engine is None:
            model = self.reference if self.reference is not None else self._initial_model()
            self._frozen_engine = HFEngine(model, self.tokenizer, name="frozen")
        return self._frozen_engine

    def logprobs_of(self, batch: TrainingBatch, *, reference: bool = False) -> torch.Tensor:
        """[N, T] logprobs of batch.targets: the trained model's with gradient, or the reference's."""
        if self.colocated is not None:
            self.colocated.idle()  # the rollout is over: vLLM may free its memory until the sync
        if reference:
            if self._adapters_off_reference:  # the base model: the same module, adapters off
                module = self.ds.module
                was_training = module.training
                module.eval()
                try:
                    with torch.no_grad(), module.disable_adapter():
                        return self._logprobs(module, batch)
                finally:
                    module.train(was_training)
            if self.reference is None:
                raise ValueError("logprobs_of(reference=True): the backend was built with reference=False")
            with torch.no_grad():
                return self._logprobs(self.reference, batch)
        self.ds.train()
        return self._logprobs(self.ds, batch, entropy=True)

    def _logprobs(
        self, model: torch.nn.Module, batch: TrainingBatch, *, entropy: bool = False
    ) -> torch.Tensor:
        attention = (batch.sample_ids >= 0).long()  # [N, T] right padding
        logits = model(
            input_ids=batch.input_ids, attention_mask=attention, position_ids=batch.position_ids
        ).logits
        if entropy:  # with gradient for an entropy bonus
            grad = self.entropy_grad and torch.is_grad_enabled()
            self.token_entropy = token_entropy(logits, temperature=self.temperature, grad=grad)  # [N, T]
        return token_logprobs(logits, batch.targets, temperature=self.temperature)  # [N, T]

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed averages over DP ranks and divides by the accumulation steps; the loss is
        # already divided by the global token count, so undo both
        self.ds.backward(loss * self.groups.dp_size * self.micro_batches)
        self.ds.step()

    def optimizer_step(self) -> float:
        # DeepSpeed stepped inside the last backward (the accumulation boundary). Its ZeRO
        # optimizers (stage 1/2 and 3, in fp32 too) take the global norm over every DP rank and,
        # when it is not finite, zero the gradients and skip the update, counting it in
        # `skipped_steps`: all that is left here is to report it with a non-finite norm
        if self.ds.skipped_steps != self._skipped_seen:
            self._skipped_seen = self.ds.skipped_steps
            return float("inf")
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def set_lr(self, lr: float) -> None:
        """See `Backend.set_lr`: the ZeRO optimizer's param groups are the wrapped Adam's."""
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr

    def close(self) -> None:
        """See `Backend.close`."""
        if self.colocated is not None:
            self.colocated.close()

    def sync_engine_weights(self) -> float:
        """See `Backend.sync_engine_weights`: ZeRO-3 gathers each parameter (collective over DP).

        With the native engine nothing moves (it generates with the trained module itself): its
        prefix cache is cleared.
        """
        if self.colocated is not None:
            return self.colocated.sync()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # the cached keys/values were computed with the old weights
        return 0.0

    @torch.no_grad()
    def mix_reference(self, alpha: float) -> None:
        """The KL reference moved toward the policy: ref = alpha * policy + (1 - alpha) * ref.
        Under ZeRO-3 each policy parameter is gathered in turn (collective over the DP group, every
        rank in the same order); the reference is whole on every rank."""
        if self._adapters_off_reference:
            raise ValueError(
                "mix_reference: with LoRA the reference is the base model itself, which does not move"
            )
        if self.reference is None:
            raise ValueError("mix_reference: the backend was built with reference=False")
        own = dict(self.ds.module.named_parameters())
        for name, ref in self.reference.named_parameters():
            param = own[name]
            if self.zero_stage == 3:
                import deepspeed

                with deepspeed.zero.GatheredParameters([param]):
                    ref.lerp_(param.detach().to(ref.dtype), alpha)
            else:
                ref.lerp_(param.detach().to(ref.dtype), alpha)
        self.reference_moved = True

    def save(self, folder: Path) -> None:
        """DeepSpeed's checkpoint; a reference that `mix_reference` moved beside it (`reference/`,
        an HF folder in safetensors, written by rank 0)."""
        # with LoRA the frozen base weights are --model's: the adapters and their state alone
        self.ds.save_checkpoint(str(folder), tag="deepspeed", exclude_frozen_parameters=self.lora is not None)
        if self.lora is not None:
            self._save_adapter(folder / ADAPTER_DIR)
        if self.reference is not None and self.reference_moved and distributed.rank() == 0:
            self.reference.save_pretrained(folder / REFERENCE_DIR, safe_serialization=True)

    def load(self, folder: Path) -> None:
        # DeepSpeed's own loader reads its files with torch.load(weights_only=False): its engine
        # gets ours (weights_only=True, the few data classes allowed), and nothing that would call
        # more than plain data types gets that far anyway (interlens_mcore.distributed.safe_load)
        check_checkpoint(folder / "deepspeed")
        self.ds.checkpoint_engine.load = weights_only_load  # every read of its load_checkpoint
        # a LoRA checkpoint holds no frozen base weight: those stay as --model loaded them
        path, _ = self.ds.load_checkpoint(str(folder), tag="deepspeed", load_module_strict=self.lora is None)
        if path is None:
            raise ValueError(f"checkpoint {folder} holds no DeepSpeed state")
        self._skipped_seen = self.ds.skipped_steps  # the engine's counter comes back with it
        if self.reference is not None and (folder / REFERENCE_DIR).is_dir():
            from transformers import AutoModelForCausalLM

            # safetensors only: a pickled weights file there is refused, never loaded
            moved = AutoModelForCausalLM.from_pretrained(
                folder / REFERENCE_DIR, dtype=torch.float32, use_safetensors=True
            )
            self.reference.load_state_dict(moved.state_dict())
            self.reference_moved = True
        self.sync_engine_weights()  # a resumed run generates with the weights it resumes from

    def _save_adapter(self, folder: Path) -> None:
        self._write_adapter(folder, every_rank=False)

    def _write_adapter(self, folder: Path, *, every_rank: bool) -> None:
        """The adapters in peft's layout (safetensors), by rank 0 (a checkpoint's) or by every rank
        (each for its own vLLM); under ZeRO-3 gathered first (collective over the DP group)."""
        module = self.ds.module
        adapters = [p for p in module.parameters() if p.requires_grad]
        if self.zero_stage == 3:
            import deepspeed

            gathered: Any = deepspeed.zero.GatheredParameters(adapters)
        else:
            gathered = contextlib.nullcontext()
        with gathered:
            if every_rank or distributed.rank() == 0:
                module.save_pretrained(folder, safe_serialization=True)

    def export_hf(self, out_dir: str | Path) -> Path:
        """Not available: HF export is the megatron backend's (`--export-hf` says so too)."""
        raise ValueError(f"export_hf({str(out_dir)!r}) is available with the megatron backend only")
