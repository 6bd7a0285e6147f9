"""`TrainerConfig` (the GRPO loop, its optimizer, outputs and logging) and `BackendConfig`.

These dataclasses are the one source of the options: `interlens_mcore/cli/args.py` generates the command line
and the YAML keys from them (field name = option name), so a default here is the default
everywhere. Runtime objects (model, groups, tokenizer) are constructor arguments, never fields.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from .backends.registry import BACKENDS

REPORTERS = ("jsonl", "tensorboard", "wandb")
MAX_EXTRA_ROUNDS = 3  # --dynamic-sampling's cap, ms-swift's max_resample_times default
REF_MIXUP_ALPHA, REF_SYNC_STEPS = 0.6, 512  # --sync-ref-model's, TRL's defaults
KL_TARGET, KL_HORIZON = 0.1, 10000  # --kl-ctrl adaptive's, verl's defaults
KLControl = Literal["fixed", "adaptive"]
KL_CONTROLS: tuple[str, ...] = get_args(KLControl)


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The outer loop, the optimizer, checkpoints, evaluation and logging."""

    steps: int = field(
        default=600, metadata={"help": "optimizer steps of the run (a resumed run may raise it)"}
    )
    batch_size: int = field(
        default=64, metadata={"help": "samples per rank per step: a multiple of --num-generations"}
    )
    lr: float = field(default=1e-3, metadata={"help": "AdamW learning rate (the peak, with a schedule)"})
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = field(
        default="constant",
        metadata={
            "help": "learning rate after the warmup: constant, or decaying (linear, cosine) to 0 at --steps"
        },
    )
    warmup_ratio: float = field(
        default=0.0, metadata={"help": "share of --steps whose learning rate rises linearly to --lr"}
    )
    warmup_steps: int = field(
        default=0,
        metadata={"help": "steps whose learning rate rises linearly to --lr (instead of --warmup-ratio)"},
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this"})
    updates_per_rollout: int = field(
        default=1, metadata={"help": "optimizer steps per rollout batch (> 1: old logprobs recomputed)"}
    )
    gradient_accumulation_steps: int = field(
        default=0,
        metadata={
            "help": "micro-batches whose gradients make one optimizer step: a rank's trajectories of a "
            "step split in N equal parts (sets --micro-batch-size; 0: from --micro-batch-size)"
        },
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "refill the batch: prompts whose samples all got one reward are replaced by more "
            "prompts, rolled out in extra rounds (verl filter_groups, ms-swift dynamic_sample)"
        },
    )
    max_extra_rounds: int = field(
        default=MAX_EXTRA_ROUNDS,
        metadata={
            "help": "--dynamic-sampling: rounds a step may add; a step still short after them fills up "
            "with its uninformative prompts"
        },
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "move the KL reference toward the policy every --ref-model-sync-steps steps: "
            "ref = alpha * policy + (1 - alpha) * ref (TRL's and ms-swift's option; needs --beta > 0)"
        },
    )
    ref_model_mixup_alpha: float = field(
        default=REF_MIXUP_ALPHA, metadata={"help": "--sync-ref-model: the policy's share alpha"}
    )
    ref_model_sync_steps: int = field(
        default=REF_SYNC_STEPS, metadata={"help": "--sync-ref-model: steps between the moves"}
    )
    kl_in_reward: bool = field(
        default=False,
        metadata={
            "help": "the KL to the reference lowers each sample's reward (beta x its KL summed over its "
            "tokens) before the advantages, instead of a loss term (verl use_kl_in_reward, ms-swift "
            "kl_in_reward); --beta is the coefficient, --kl-estimator the estimate"
        },
    )
    kl_ctrl: KLControl = field(
        default="fixed",
        metadata={
            "help": "--kl-in-reward: the coefficient stays --beta (fixed) or follows --kl-target "
            "(adaptive: verl's kl_ctrl.type)"
        },
    )
    kl_target: float = field(
        default=KL_TARGET,
        metadata={
            "help": "--kl-ctrl adaptive: the per-token KL the coefficient steers toward (verl target_kl)"
        },
    )
    kl_horizon: int = field(
        default=KL_HORIZON,
        metadata={
            "help": "--kl-ctrl adaptive: samples after which an error e (kl / target - 1, clipped to "
            "+-0.2) has scaled the coefficient by 1 + e (verl kl_ctrl.horizon)"
        },
    )
    save_every: int = field(
        default=10, metadata={"help": "steps between checkpoints (the last is always saved)"}
    )
    save_total_limit: int = field(default=2, metadata={"help": "checkpoints kept (the newest ones)"})
    eval_every: int = field(
        default=100,
        metadata={"help": "steps between evaluations on held-out rows (0: never); also at the end"},
    )
    eval_size: int = field(
        default=128, metadata={"help": "held-out rows per rank (per seat in multi-seat games)"}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "run folder (default: a new runs/<task>-<timestamp>)"}
    )
    report_to: str = field(
        default="jsonl",
        metadata={"help": "comma-separated loggers: jsonl, tensorboard, wandb (offline works)"},
    )
    log_completions_every: int = field(
        default=10, metadata={"help": "steps between sample completions in completions.jsonl (0: never)"}
    )
    log_completions: int = field(default=4, metadata={"help": "trajectories written each time"})
    collective_timeout_s: float = field(
        default=600.0,
        metadata={
            "help": "seconds a rank waits in a collective (process groups, the rollout vote, the "
            "world check) before failing with the collective and the stage named; must exceed the "
            "longest wait of one rank for another (a rollout or evaluation one rank finishes first)"
        },
    )
    save_on_signal: bool = field(
        default=True,
        metadata={
            "help": "SIGTERM / SIGINT (preemption, Ctrl-C): finish the step, save a checkpoint and exit 0; "
            "a second signal stops at once"
        },
    )
    sft_data: str | None = field(
        default=None,
        metadata={
            "help": "JSONL of demonstration conversations (one OpenAI message list a line): supervised "
            "steps on the assistant turns before the first GRPO step (docs/tasks.md, Demonstrations)"
        },
    )
    sft_steps: int = field(default=100, metadata={"help": "--sft-data: supervised optimizer steps"})
    sft_lr: float = field(
        default=1e-5, metadata={"help": "--sft-data: AdamW learning rate of the supervised steps"}
    )
    sft_batch_size: int = field(
        default=8, metadata={"help": "--sft-data: demonstrations per supervised step, per DP rank"}
    )
    ref_from: Literal["policy", "base"] = field(
        default="policy",
        metadata={
            "help": "with --sft-data and --beta > 0: the KL reference is the warmed-up policy (policy) "
            "or the --model weights (base); with LoRA it is always the base model"
        },
    )
    max_failed_fraction: float = field(
        default=0.5,
        metadata={
            "help": "end the run (exit 2) when more than this share of a step's samples, over all ranks, "
            "failed (a scheduler, environment or tool raised for them; see --on-sample-error)"
        },
    )

    def __post_init__(self) -> None:
        if self.steps < (0 if self.sft_data else 1):  # 0: the supervised warm-up alone
            raise ValueError(f"TrainerConfig.steps must be >= 1 (>= 0 with --sft-data), got {self.steps}")
        for name in (
            "batch_size",
            "updates_per_rollout",
            "save_every",
            "save_total_limit",
            "eval_size",
            "sft_steps",
            "sft_batch_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainerConfig.{name} must be >= 1, got {getattr(self, name)}")
        counts = ("eval_every", "log_completions_every", "log_completions", "warmup_steps")
        for name in (*counts, "max_extra_rounds"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainerConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_extra_rounds != MAX_EXTRA_ROUNDS and not self.dynamic_sampling:
            what = "TrainerConfig.max_extra_rounds caps the rounds of --dynamic-sampling"
            raise ValueError(f"{what}: give it too")
        self._check_reference_sync()
        self._check_kl_in_reward()
        for name in ("lr", "weight_decay", "grad_clip"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"TrainerConfig.{name} must be a finite number, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"TrainerConfig.lr must be > 0, got {self.lr}")
        if not 0 < self.sft_lr < float("inf"):
            raise ValueError(f"TrainerConfig.sft_lr must be a finite number > 0, got {self.sft_lr}")
        if not self.grad_clip > 0:
            raise ValueError(f"TrainerConfig.grad_clip must be > 0, got {self.grad_clip}")
        self._check_schedule()
        if not 0 <= self.max_failed_fraction <= 1:  # nan fails too
            raise ValueError(
                f"TrainerConfig.max_failed_fraction must be in [0, 1], got {self.max_failed_fraction}"
            )
        if not 0 < self.collective_timeout_s < float("inf"):
            raise ValueError(
                f"TrainerConfig.collective_timeout_s must be a finite number of seconds > 0, "
                f"got {self.collective_timeout_s}"
            )
        unknown = [r for r in self.reporters if r not in REPORTERS]
        if unknown or not self.reporters:
            raise ValueError(
                f"TrainerConfig.report_to must list some of {', '.join(REPORTERS)}, got {self.report_to!r}"
            )

    def _check_reference_sync(self) -> None:
        given = self.ref_model_mixup_alpha != REF_MIXUP_ALPHA or self.ref_model_sync_steps != REF_SYNC_STEPS
        if given and not self.sync_ref_model:
            raise ValueError(
                "TrainerConfig.ref_model_mixup_alpha and TrainerConfig.ref_model_sync_steps shape "
                "--sync-ref-model: give it too"
            )
        alpha, steps = self.ref_model_mixup_alpha, self.ref_model_sync_steps
        if not 0 < alpha <= 1:  # nan fails too
            raise ValueError(f"TrainerConfig.ref_model_mixup_alpha must be in (0, 1], got {alpha}")
        if steps < 1:
            raise ValueError(f"TrainerConfig.ref_model_sync_steps must be >= 1, got {steps}")

    def _check_kl_in_reward(self) -> None:
        given = self.kl_ctrl != "fixed" or self.kl_target != KL_TARGET or self.kl_horizon != KL_HORIZON
        if given and not self.kl_in_reward:
            raise ValueError(
                "TrainerConfig.kl_ctrl, TrainerConfig.kl_target and TrainerConfig.kl_horizon shape "
                "TrainerConfig.kl_in_reward: give it too"
            )
        if self.kl_ctrl not in KL_CONTROLS:
            raise ValueError(f"TrainerConfig.kl_ctrl must be fixed or adaptive, got {self.kl_ctrl!r}")
        if not 0 < self.kl_target < float("inf"):  # nan fails too
            raise ValueError(f"TrainerConfig.kl_target must be a finite number > 0, got {self.kl_target}")
        if self.kl_horizon < 1:
            raise ValueError(f"TrainerConfig.kl_horizon must be >= 1, got {self.kl_horizon}")

    def _check_schedule(self) -> None:
        if self.gradient_accumulation_steps < 0:
            n = self.gradient_accumulation_steps
            raise ValueError(f"TrainerConfig.gradient_accumulation_steps must be >= 0, got {n}")
        if not 0 <= self.warmup_ratio < 1:  # nan fails too
            raise ValueError(f"TrainerConfig.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_ratio and self.warmup_steps:
            raise ValueError(
                "TrainerConfig.warmup_steps and --warmup-ratio both set: they say the same thing (keep one)"
            )
        if self.lr_scheduler_type not in ("constant", "linear", "cosine"):
            raise ValueError(
                "TrainerConfig.lr_scheduler_type must be constant, linear or cosine, "
                f"got {self.lr_scheduler_type!r}"
            )

    def micro_batch_size(self, trajectories_per_rank: int, micro_batch_size: int) -> int:
        """The trajectories of one micro-batch: --gradient-accumulation-steps N splits a rank's
        `trajectories_per_rank` into N equal micro-batches, else `micro_batch_size` (0: one)."""
        n = self.gradient_accumulation_steps
        if not n:
            return micro_batch_size
        if trajectories_per_rank % n:
            raise ValueError(
                f"TrainerConfig.gradient_accumulation_steps {n} does not divide the {trajectories_per_rank} "
                "trajectories of a rank's step (--batch-size x trained seats) into equal micro-batches"
            )
        size = trajectories_per_rank // n
        if micro_batch_size and micro_batch_size != size:
            # TRL's batch is per_device_train_batch_size x gradient_accumulation_steps: say which
            # --batch-size that is here
            wanted, rem = divmod(self.batch_size * micro_batch_size * n, trajectories_per_rank)
            other = f", or --batch-size {wanted} for N micro-batches of {micro_batch_size}" if not rem else ""
            raise ValueError(
                f"TrainerConfig.gradient_accumulation_steps {n} makes micro-batches of {size} trajectories "
                f"but --micro-batch-size is {micro_batch_size} (give one of them{other})"
            )
        return size

    @property
    def reporters(self) -> list[str]:
        return [r.strip() for r in self.report_to.split(",") if r.strip()]


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """Which training backend holds the model, and how it is split."""

    backend: str = field(
        default="megatron",
        metadata={
            "help": "megatron (megatron-core GPTModel) or deepspeed (HF model, ZeRO)",
            "choices": tuple(BACKENDS),
        },
    )
    model: str | None = field(
        default=None,
        metadata={
            "help": "HF folder or sharded megatron checkpoint, smollm2 (SmolLM2-135M-Instruct), or tiny "
            "(the tiny Qwen2 model after a short supervised phase on guess-a-number); default: the "
            "task's (smollm2 for reasoning_gym, gym and textarena), else tiny"
        },
    )
    tp: int = field(default=1, metadata={"help": "tensor-parallel size (megatron); may change on --resume"})
    pp: int = field(
        default=1,
        metadata={
            "help": "pipeline-parallel size (megatron backend, CPU path: megatron's 1F1B schedule; with "
            "--engine vllm each stage's TP group runs a vLLM of the whole model: docs/parallelism.md); "
            "may change on --resume"
        },
    )
    cp: int = field(default=1, metadata={"help": "context-parallel size (only 1 yet: docs/parallelism.md)"})
    zero_stage: Literal[1, 2, 3] = field(default=3, metadata={"help": "DeepSpeed ZeRO stage"})
    engine: Literal["native", "vllm"] = field(
        default="native",
        metadata={
            "help": "what generates the rollouts: native (the backend's own model: MegatronEngine or "
            "HFEngine) or vllm (colocated in the training ranks, weights synced after every step; "
            "needs the vllm extra)"
        },
    )
    bf16: bool = field(
        default=False,
        metadata={
            "help": "megatron backend: forwards (training and the native engine) under bfloat16 "
            "autocast, float32 weights and optimizer; on a CPU with AVX512-BF16 or AMX its matmuls "
            "run several times faster"
        },
    )
    recompute: bool = field(
        default=False,
        metadata={
            "help": "activation checkpointing: keep each transformer layer's input only and recompute "
            "its activations in the backward (megatron's full recompute on GPU, torch's checkpoint per "
            "layer on CPU; HF gradient checkpointing on the deepspeed backend): less memory, one more "
            "forward of the layers"
        },
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "with --engine vllm on GPU: the share of GPU memory vLLM may take"}
    )
    vllm_sleep: bool = field(
        default=False,
        metadata={"help": "with --engine vllm on GPU: free vLLM's weights and KV cache during training"},
    )
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto",
        metadata={
            "help": "with --engine vllm: the dtype vLLM computes in; auto is the trainer's (bfloat16 with "
            "--bf16, else float32), so rollout and training logprobs of a token agree"
        },
    )

    vllm_lora: Literal["auto", "merged", "adapter"] = field(
        default="auto",
        metadata={
            "help": "with --engine vllm and --lora-rank: how the adapters reach vLLM after each update: "
            "merged (W + alpha/rank * B A streamed as whole weights; megatron), adapter (the adapters "
            "alone, through vLLM's LoRA path, enable_lora); auto: merged on megatron, adapter on deepspeed"
        },
    )
    lora_rank: int = field(
        default=0,
        metadata={
            "help": "train LoRA adapters of this rank instead of the whole model (peft on the deepspeed "
            "backend; TP-split adapters on megatron's parallel linears); the KL reference is then the "
            "base model with the adapters off, no second copy. 0: full fine-tuning"
        },
    )
    lora_alpha: float = field(
        default=32.0, metadata={"help": "with --lora-rank: LoRA's scale numerator (alpha / rank)"}
    )
    lora_dropout: float = field(
        default=0.05, metadata={"help": "with --lora-rank: dropout on the adapters' input"}
    )
    lora_target_modules: str = field(
        default="all-linear",
        metadata={
            "help": "with --lora-rank: comma-separated module names to adapt (q_proj,v_proj,...), or "
            "all-linear (every linear layer but the output head, as peft and ms-swift)"
        },
    )

    def __post_init__(self) -> None:
        self._check_lora()
        if self.backend not in BACKENDS:
            raise ValueError(f"BackendConfig.backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.tp < 1:
            raise ValueError(f"BackendConfig.tp must be >= 1, got {self.tp}")
        if self.pp < 1:
            raise ValueError(f"BackendConfig.pp must be >= 1, got {self.pp}")
        if self.pp > 1:
            self._check_pipelined()
        if self.backend == "deepspeed" and self.tp != 1:
            raise ValueError(
                f"BackendConfig.tp {self.tp}: the deepspeed backend has no tensor parallelism (use --tp 1)"
            )
        if self.bf16 and self.backend != "megatron":
            raise ValueError(
                f"BackendConfig.bf16 is for the megatron backend; --backend {self.backend} computes "
                "in the model's own dtype (drop --bf16)"
            )
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"BackendConfig.zero_stage must be 1, 2 or 3, got {self.zero_stage}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(
                "BackendConfig.vllm_gpu_memory_utilization must be in (0, 1], "
                f"got {self.vllm_gpu_memory_utilization}"
            )

    def _check_pipelined(self) -> None:
        if self.backend != "megatron":
            raise ValueError(
                f"BackendConfig.pp {self.pp}: the {self.backend} backend has no pipeline parallelism "
                "(use --pp 1, or --backend megatron)"
            )
        if self.engine != "native" and self.lora_rank and self.vllm_lora == "adapter":
            raise ValueError(
                f"BackendConfig.pp {self.pp} with BackendConfig.vllm_lora 'adapter': vLLM's LoRA path "
                "needs the whole adapters on every rank, which are not gathered across stages yet; "
                "use --vllm-lora merged (the megatron default)"
            )
        if self.lora_rank and self.lora_dropout > 0 and self.recompute:
            # megatron's schedule keeps several micro-batches in flight: a layer recomputed in a
            # backward would draw another micro-batch's dropout mask
            raise ValueError(
                f"BackendConfig.pp {self.pp} with LoRA dropout {self.lora_dropout} and recompute: the "
                "recomputed layers would not draw their forward's dropout masks; use --lora-dropout 0 "
                "or drop --recompute"
            )

    def _check_lora(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(
                f"BackendConfig.lora_rank must be >= 0 (0: full fine-tuning), got {self.lora_rank}"
            )
        if not self.lora_rank:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name in ("lora_alpha", "lora_dropout", "lora_target_modules", "vllm_lora"):
                if getattr(self, name) != defaults[name]:
                    raise ValueError(
                        f"BackendConfig.{name} shapes LoRA adapters: give BackendConfig.lora_rank > 0"
                    )
            return
        if self.vllm_lora != "auto" and self.engine == "native":
            raise ValueError(
                f"BackendConfig.vllm_lora {self.vllm_lora!r} says how adapters reach vLLM: give --engine vllm"
            )
        if self.vllm_lora == "merged" and self.backend != "megatron":
            raise ValueError(
                f"BackendConfig.vllm_lora 'merged': the {self.backend} backend hands vLLM its adapters "
                "(--vllm-lora adapter); merged weights come from --backend megatron"
            )
        if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ValueError(f"BackendConfig.lora_alpha must be a finite number > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"BackendConfig.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not lora_targets(self.lora_target_modules):
            raise ValueError(
                f"BackendConfig.lora_target_modules {self.lora_target_modules!r}: expected module names "
                "separated by commas (q_proj,v_proj) or all-linear"
            )
        if self.backend == "megatron":
            from interlens_mcore.megatron.lora import HF_PROJECTIONS

            names = {"all-linear", *HF_PROJECTIONS, *(hf for hfs in HF_PROJECTIONS.values() for hf in hfs)}
            unknown = [n for n in self.lora_target_modules.split(",") if n.strip() and n.strip() not in names]
            if unknown:
                known = ", ".join(sorted(names - {"all-linear"}))
                raise ValueError(
                    f"BackendConfig.lora_target_modules {self.lora_target_modules!r}: {unknown[0].strip()!r} "
                    f"is not a linear layer of the Megatron model; expected all-linear or among {known}"
                )


def lora_targets(value: str) -> str | list[str]:
    """peft's `target_modules` from --lora-target-modules: "all-linear", or the list of names."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names == ["all-linear"]:
        return "all-linear"
    return (
        [] if "all-linear" in names or any(not n.replace(".", "_").isidentifier() for n in names) else names
    )
