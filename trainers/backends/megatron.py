"""`MegatronBackend`: a megatron-core GPTModel converted from an HF folder, TP x DP.

Placement: megatron's parallel_state splits the world into TP groups (one model shard each)
and DP groups (replicas). The rollout group is the TP group of one DP index: its ranks bring
distinct conversations to each (collective) generation call, then share their trajectories,
because a TP forward needs identical inputs on every rank of the group (the GRPO loop does
that for any backend whose groups have TP > 1).

LoRA (`--lora-rank`, `lora=LoRAOptions(...)`): adapters on megatron's column- and row-parallel
layers, split over TP like their weights (`interlens_mcore.megatron.lora`); only they reach the
optimizer, and the KL reference is the same model with its adapters off, no second copy. A
colocated vLLM receives the merged weights (W + scale * B A) after each update.
Checkpoints hold the adapters and their optimizer state alone (the base is `--model`'s) and
`adapter/` in peft's layout; `export_hf` writes the merged model with that `adapter/` inside.

Training goes through one seam (`interlens_mcore.megatron.training`): on GPU megatron's own
DistributedDataParallel and distributed optimizer (bf16 weights, fp32 main weights); on CPU,
where those need CUDA, torch DDP over the DP group and a torch AdamW. Checkpoints are sharded
(`interlens_mcore.megatron.checkpoint`) and reshard: a run saved at TP=2 resumes at TP=1.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from interlens_mcore import distributed
from interlens_mcore.engines.base import Engine
from interlens_mcore.engines.vllm import VLLMConfig
from interlens_mcore.engines.weight_sync import megatron_hf_tensors
from interlens_mcore.grpo.batch import Layout, TrainingBatch
from interlens_mcore.grpo.logprobs import (
    token_entropy,
    token_logprobs,
    vocab_parallel_token_entropy,
    vocab_parallel_token_logprobs,
)
from interlens_mcore.megatron import build_model, export_hf, forward_logits, load_layout, pipeline
from interlens_mcore.megatron import checkpoint as megatron_checkpoint
from interlens_mcore.megatron import lora as megatron_lora
from interlens_mcore.megatron.convert import gather_adapter_state_dict
from interlens_mcore.megatron.engine import MegatronEngine
from interlens_mcore.megatron.lora import LoRAOptions
from interlens_mcore.megatron.model import compute_autocast, vocab_start
from interlens_mcore.megatron.spec import SpecKind
from interlens_mcore.megatron.stages import pipeline_size
from interlens_mcore.megatron.training import TrainingOptions, build_training, choose_path, model_overrides
from interlens_mcore.megatron.weights import copy_hf_files, load_weights

from ..config import BackendConfig, TrainerConfig, lora_targets
from .base import ADAPTER_DIR, REFERENCE_DIR
from .colocated_vllm import ColocatedVLLM, vllm_config


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
) -> tuple[MegatronBackend, distributed.ParallelGroups]:
    """`base.BackendBuilder` for `--backend megatron`: megatron's TP x DP split, then the model."""
    distributed.init_megatron(cfg.tp, pp=cfg.pp, timeout_s=trainer.collective_timeout_s)
    groups = distributed.build_groups(rollout="model_parallel", vote_timeout_s=trainer.collective_timeout_s)
    backend = MegatronBackend(
        model_path=model_path,
        groups=groups,
        lr=trainer.lr,
        weight_decay=trainer.weight_decay,
        grad_clip=trainer.grad_clip,
        temperature=temperature,
        reference=reference,
        tokenizer=tokenizer,
        vllm=vllm_config(cfg, groups.tp_size),  # vLLM's TP group is the trainer's TP group
        compute_dtype=torch.bfloat16 if cfg.bf16 else None,
        lora=lora_options(cfg),
        recompute=cfg.recompute,
    )
    return backend, groups


def _check_pipelined(*, path: str, vllm: VLLMConfig | None) -> None:
    """ValueError naming what pipeline parallelism cannot run with yet."""
    if path != "torch":
        raise ValueError(
            "--pp > 1 trains through megatron's schedule on the CPU path only so far; on GPU its DDP "
            "and distributed optimizer over stages are not built yet (use --pp 1)"
        )
    if vllm is not None and vllm.max_lora_rank > 0:
        raise ValueError(
            "--pp > 1 with --vllm-lora adapter: the adapters are not gathered across stages yet "
            "(use --vllm-lora merged)"
        )


def lora_options(cfg: BackendConfig) -> LoRAOptions | None:
    """The adapters of the --lora-* options (None without --lora-rank)."""
    if not cfg.lora_rank:
        return None
    megatron_lora.peft_config_class()  # refused now, not at the first checkpoint, without peft
    targets = lora_targets(cfg.lora_target_modules)
    return LoRAOptions(
        rank=cfg.lora_rank,
        alpha=cfg.lora_alpha,
        dropout=cfg.lora_dropout,
        target_modules=targets if isinstance(targets, str) else tuple(targets),
    )


class MegatronBackend:
    """A megatron-core model for GRPO; `distributed.init_megatron(tp)` must have run.

    `reference=True` keeps a frozen copy of the initial weights for the KL term; with `lora` the
    reference is the same model with its adapters off (no copy). With `vllm`
    (its `tensor_parallel_size` the TP size) a colocated vLLM over each TP group generates
    instead of `MegatronEngine`, and `sync_engine_weights` gathers the TP shards (and under PP
    every stage's layers) into it.
    """

    layout: Layout = "packed"
    pad_to_multiple = 1
    micro_batches: int | None = None  # any number of micro-batches per step

    def __init__(
        self,
        *,
        model_path: str | Path,
        groups: distributed.ParallelGroups,
        lr: float,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        temperature: float = 1.0,
        reference: bool = False,
        seed: int = 0,
        tokenizer: PreTrainedTokenizerBase | None = None,
        vllm: VLLMConfig | None = None,
        compute_dtype: torch.dtype | None = None,
        lora: LoRAOptions | None = None,
        recompute: bool = False,
    ):
        self.groups, self.temperature, self.tokenizer = groups, temperature or 1.0, tokenizer
        # the policy's entropy at each position of its last forward (the `entropy` metric), no grad
        self.token_entropy: torch.Tensor | None = None
        self.entropy_grad = False  # set by the step when an entropy bonus needs the gradient
        # set by the step (trainers.update): logprobs and entropy at the trained positions only,
        # 0 elsewhere (PP=1; the pipeline's stages compute every position)
        self.trained_only = False
        self._frozen_engine: MegatronEngine | None = None  # a frozen opponent's: built on first use
        self.compute_dtype = compute_dtype  # autocast dtype of every forward (None: the weights')
        self.model_path = Path(model_path)  # an HF folder or a sharded megatron checkpoint
        self.layout_info = load_layout(self.model_path)
        options = TrainingOptions(lr=lr, weight_decay=weight_decay, grad_clip=grad_clip, recompute=recompute)
        self.path = choose_path()  # megatron's DDP and optimizer on GPU, torch's on CPU
        self.pp = pipeline_size()
        if self.pp > 1:
            _check_pipelined(path=self.path, vllm=vllm)
        # under PP: (batch, d loss / d logprobs, d loss / d entropy or None, the LoRA forward
        # number) of each backward, run through megatron's schedule at the optimizer step
        # (see `backward`)
        self._deferred: list[tuple[TrainingBatch, torch.Tensor, torch.Tensor | None, int]] = []
        # the batch, logprobs, entropy (with an entropy bonus) and forward number the next
        # backward differentiates
        self._pending: tuple[TrainingBatch, torch.Tensor, torch.Tensor | None, int] | None = None
        overrides = model_overrides(options, path=self.path, tp_size=self.layout_info.tp_size)
        self.params_dtype = overrides.pop("params_dtype", torch.float32)
        if lora is not None and compute_dtype is not None and self.path == "torch":
            # the frozen base never trains, so it needs no float32 copy: held in the compute dtype
            # it takes half the memory, and autocast (which caches the casts of trainable weights
            # only) does not cast every frozen weight again at every call
            self.params_dtype = compute_dtype
        self.overrides = overrides
        if self.path == "megatron":
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        self.lora = lora
        self.model = self._initial_model(trainable=True)
        if lora is not None:
            # freezes the base; the adapters train in float32 under torch's AdamW
            adapters = torch.float32 if self.path == "torch" else None
            megatron_lora.attach(self.model, self.layout_info, lora, dtype=adapters)
        # with LoRA the reference is the base model under the adapters: nothing more to build
        self.reference = self._initial_model() if reference and lora is None else None
        self._adapters_off_reference = reference and lora is not None
        self.reference_moved = False  # mix_reference moved it off the initial weights: it is saved
        self.training = build_training(self.model, options, groups, path=self.path)
        self.train_model, self.optimizer = self.training.train_model, self.training.optimizer
        self.colocated: ColocatedVLLM | None = None
        self.engine: Engine
        if vllm is not None:
            if vllm.tensor_parallel_size != groups.tp_size:
                raise ValueError(
                    f"VLLMConfig.tensor_parallel_size {vllm.tensor_parallel_size} must equal the "
                    f"trainer's TP {groups.tp_size}: vLLM's TP group is the rollout group"
                )
            adapter = None
            if vllm.max_lora_rank > 0:  # the adapters through vLLM's LoRA path, over the base weights
                if lora is None:
                    raise ValueError("VLLMConfig.max_lora_rank > 0 loads LoRA adapters: give lora=")
                adapter = self._write_adapter
            self.colocated = ColocatedVLLM(
                self.model_path,
                vllm,
                # vLLM's TP group is the trainer's (consecutive ranks, as vLLM's launcher groups
                # them); under PP each stage's TP group runs a vLLM of the whole model on its own
                # rows, the weights of every stage reaching it at each sync (megatron_hf_tensors)
                group=groups.tp,
                tensors=self._base_tensors if adapter else self._hf_tensors,
                adapter=adapter,
            )
            self.engine = self.colocated.engine
        else:
            # the tokenizer decodes sampled ids for stop strings (a tool call's closing tag)
            self.engine = MegatronEngine(
                self.model,
                self.layout_info,
                group=groups.rollout,
                tp_group=groups.tp,
                tokenizer=tokenizer,
                compute_dtype=compute_dtype,
            )

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self._adapters_off_reference

    def _initial_model(self, *, trainable: bool = False) -> torch.nn.Module:
        # a second model from the same folder (megatron modules hold process groups: no deepcopy)
        # Transformer Engine's spec fuses the norms into the linears, whose input is then the
        # un-normed one: adapters need the local spec's plain linears
        spec: SpecKind | None = "local" if self.lora is not None and self.path == "megatron" else None
        model = build_model(
            self.layout_info, init_weights=False, spec=spec, params_dtype=self.params_dtype, **self.overrides
        )
        load_weights(model, self.layout_info, self.model_path)
        if self.path == "megatron":
            model = model.cuda()
        return model if trainable else model.eval().requires_grad_(False)

    def frozen_engine(self) -> MegatronEngine:
        """The initial weights (the KL reference when there is one), generating as "frozen"."""
        if self._frozen_engine is None:
            model = self.reference if self.reference is not None else self._initial_model()
            self._frozen_engine = MegatronEngine(
                model,
                self.layout_info,
                group=self.groups.rollout,
                tp_group=self.groups.tp,
                name="frozen",
                tokenizer=self.tokenizer,
                compute_dtype=self.compute_dtype,
            )
        return self._frozen_engine

    def _drop_kept_prefixes(self) -> None:
        """Our engines forget the keys/values they kept across turns."""
        for engine in (self.engine, self._frozen_engine):
            if isinstance(engine, MegatronEngine):
                engine.clear()

    def logprobs_of(self, batch: TrainingBatch, *, reference: bool = False) -> torch.Tensor:
        """[1, T] logprobs of batch.targets: the trained model's with gradient, or the reference's."""
        self._drop_kept_prefixes()  # the rollout is over: its kept keys/values only take memory now
        if batch.layout != "packed" or batch.num_tokens != batch.input_ids.shape[1]:
            raise ValueError("MegatronBackend needs packed batches without padding (pad_to_multiple=1)")
        if self.colocated is not None:
            self.colocated.idle()  # the rollout is over: vLLM may free its memory until the sync
        if reference:
            if self._adapters_off_reference:  # the base model: the same module, adapters off
                with torch.no_grad(), megatron_lora.adapters_off(self.model):
                    return self._logprobs(self.model, batch)
            if self.reference is None:
                raise ValueError("logprobs_of(reference=True): the backend was built with reference=False")
            with torch.no_grad():
                return self._logprobs(self.reference, batch)
        self.train_model.train()
        return self._logprobs(self.train_model, batch, entropy=True)

    def _logprobs(
        self, model: torch.nn.Module, batch: TrainingBatch, *, entropy: bool = False
    ) -> torch.Tensor:
        if self.pp > 1:
            return self._pipeline_logprobs(model, batch, entropy=entropy)
        # the step's forwards need the trained positions only: the output layer projects those
        rows = batch.loss_mask[0].nonzero().squeeze(1) if self.trained_only else None
        logits = forward_logits(  # [T or len(rows), V_pad / tp]
            model,
            self.layout_info,
            batch.input_ids,
            batch.cu_seqlens,
            compute_dtype=self.compute_dtype,
            rows=rows,
        )
        targets = batch.targets[0] if rows is None else batch.targets[0][rows]
        t = self.temperature
        grad = self.entropy_grad and torch.is_grad_enabled()  # an entropy bonus differentiates it
        if self.groups.tp_size == 1:
            lp = token_logprobs(logits, targets, temperature=t)
            if entropy:
                self.token_entropy = token_entropy(logits, temperature=t, grad=grad)[None]
        else:
            lp = vocab_parallel_token_logprobs(
                logits,
                targets,
                vocab_start=vocab_start(self.layout_info),
                temperature=t,
                group=self.groups.tp,
            )
            if entropy:  # exact under TP: from the shards, the same on every rank of the group
                h = vocab_parallel_token_entropy(logits, temperature=t, group=self.groups.tp, grad=grad)
                self.token_entropy = h[None]
        if rows is not None:  # back to [T]: 0 where nothing is trained
            size = batch.targets.shape[1]
            lp = lp.new_zeros(size).index_put((rows,), lp)
            if entropy and self.token_entropy is not None:
                h = self.token_entropy[0]
                self.token_entropy = h.new_zeros(size).index_put((rows,), h)[None]
        return lp[None]  # [1, T]

    def _pipeline_logprobs(
        self, model: torch.nn.Module, batch: TrainingBatch, *, entropy: bool
    ) -> torch.Tensor:
        """[1, T] logprobs through the pipeline's stages (forward only; on every stage). With
        gradient they are a leaf that `backward` differentiates the loss by. A policy forward
        also sets `token_entropy` (from the last stage); with `entropy_grad` (an entropy bonus) it
        is a leaf with gradient too."""
        hs: list[torch.Tensor] | None = [] if entropy else None
        forward = megatron_lora.forward_number(model)  # LoRA dropout's masks: the replay draws them again
        (lp,) = pipeline.run(
            model,
            self.layout_info,
            [batch],
            temperature=self.temperature,
            compute_dtype=self.compute_dtype,
            entropies=hs,
        )
        if hs:
            self.token_entropy = hs[0]
        if not torch.is_grad_enabled():
            return lp
        leaf = lp.detach().requires_grad_(True)
        h_leaf = None
        if hs and self.entropy_grad:
            h_leaf = self.token_entropy = hs[0].detach().requires_grad_(True)
        self._pending = (batch, leaf, h_leaf, forward)
        return leaf

    def backward(self, loss: torch.Tensor) -> None:
        if self.pp > 1:
            # The loss depends on the weights only through the logprobs (and, with an entropy
            # bonus, the entropies) of `_pipeline_logprobs`: keep d loss / d logprobs (and
            # d loss / d entropy), and let megatron's schedule backpropagate
            # sum(logprobs * that) (+ sum(entropy * that)) through the stages at the optimizer
            # step, every micro-batch of the update in one 1F1B run (the same gradient, one more
            # forward per micro-batch)
            pending, self._pending = self._pending, None
            if pending is None:
                raise RuntimeError("backward under PP: no logprobs with gradient since the last backward")
            batch, lp, h, forward = pending
            leaves = [lp] if h is None else [lp, h]
            grads = [
                torch.zeros_like(x) if g is None else g.detach()
                for x, g in zip(leaves, torch.autograd.grad(loss, leaves, allow_unused=True), strict=True)
            ]
            self._deferred.append((batch, grads[0], grads[1] if h is not None else None, forward))
            return
        # megatron's linear layers save the autocast state of the CUDA device for their backward;
        # on CPU the backward itself runs under autocast, so its matmuls see one dtype
        with compute_autocast(loss.device.type, self.compute_dtype):
            self.training.backward(loss)

    def optimizer_step(self) -> float:
        """See `Backend.optimizer_step`: one global norm on every rank, a non-finite one skips."""
        if self._deferred:
            batches = [b for b, _, _, _ in self._deferred]
            grads = [(g, g_h) for _, g, g_h, _ in self._deferred]
            forwards = [n for _, _, _, n in self._deferred]
            self._deferred = []
            with_entropy = any(g_h is not None for _, g_h in grads)

            def loss_of(i: int, lp: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
                g, g_h = grads[i]
                loss = (lp * g.to(lp.dtype)).sum()
                return loss if h is None or g_h is None else loss + (h * g_h.to(h.dtype)).sum()

            # each micro-batch's forward again as it was: LoRA's dropout draws the masks of the
            # forward whose logprobs the loss saw; the count then goes on from where it was
            with megatron_lora.replaying(self.model, forwards) as before_forward:
                pipeline.run(
                    self.model,
                    self.layout_info,
                    batches,
                    temperature=self.temperature,
                    compute_dtype=self.compute_dtype,
                    loss_of=loss_of,
                    entropy_grad=with_entropy,
                    before_forward=before_forward,
                )
        return self.training.step()

    def set_lr(self, lr: float) -> None:
        """See `Backend.set_lr`: torch's AdamW and megatron's optimizers both read their param groups."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def close(self) -> None:
        """See `Backend.close`."""
        if self.colocated is not None:
            self.colocated.close()

    def sync_engine_weights(self) -> float:
        """See `Backend.sync_engine_weights`: TP shards gathered into vLLM (collective over TP);
        our engines drop the keys/values they kept across turns (made by the old weights)."""
        self._drop_kept_prefixes()
        return self.colocated.sync() if self.colocated is not None else 0.0

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient (collective over TP), float64 (CPU path)."""
        return self.training.grad_norm()

    @torch.no_grad()
    def mix_reference(self, alpha: float) -> None:
        """The KL reference moved toward the policy: ref = alpha * policy + (1 - alpha) * ref, shard by
        shard (both models are split alike; no collective). From then on checkpoints hold it."""
        if self.reference is None:
            raise ValueError("mix_reference: the backend was built with reference=False")
        for (name, ref), (other, own) in zip(
            self.reference.named_parameters(), self.model.named_parameters(), strict=True
        ):
            assert name == other, f"reference and policy differ at {name} / {other}"
            ref.lerp_(own.detach().to(ref.dtype), alpha)
        self.reference_moved = True

    def save(self, folder: Path) -> None:
        """A sharded checkpoint (collective): it loads at any TP size, and as `--model` too. A
        reference that `mix_reference` moved is saved beside it (`reference/`). With LoRA: the
        adapters and their optimizer state alone, and `adapter/` in peft's layout."""
        adapters_only = self.lora is not None
        megatron_checkpoint.save(
            folder, self.model, self.layout_info, self.optimizer, adapters_only=adapters_only
        )
        if adapters_only:
            self._save_adapter(folder / ADAPTER_DIR)
        if self.reference is not None and self.reference_moved:
            megatron_checkpoint.save(folder / REFERENCE_DIR, self.reference, self.layout_info)
        if distributed.rank() == 0:
            copy_hf_files(self.model_path, folder)

    def load(self, folder: Path) -> None:
        megatron_checkpoint.load(folder, self.model, self.layout_info, self.optimizer)
        if self.reference is not None and (folder / REFERENCE_DIR).is_dir():
            megatron_checkpoint.load(folder / REFERENCE_DIR, self.reference, self.layout_info)
            self.reference_moved = True
        self.sync_engine_weights()  # a resumed run generates with the weights it resumes from

    def export_hf(self, out_dir: str | Path) -> Path:
        """The trained weights as an HF folder (collective over the world); with LoRA the merged
        model, and the adapters alone in peft's layout in its `adapter/`."""
        out = export_hf(self.model, self.layout_info, self.model_path, out_dir)
        if self.lora is not None:
            self._save_adapter(Path(out) / ADAPTER_DIR)
        return out

    def _hf_tensors(self):
        """The HF weights a vLLM sync streams (merged with the adapters when LoRA is on); collective."""
        return megatron_hf_tensors(self.model, self.layout_info)

    def _base_tensors(self):
        """The base weights alone (vLLM with its own LoRA path gets the adapters apart); collective."""
        with megatron_lora.adapters_off(self.model):
            return list(megatron_hf_tensors(self.model, self.layout_info))

    def _write_adapter(self, folder: Path) -> None:
        """This rank's copy of the whole adapters in peft's layout (for its vLLM); collective over TP."""
        assert self.lora is not None, "only a LoRA backend has adapters"
        tensors = gather_adapter_state_dict(self.model, self.layout_info)
        megatron_lora.save_peft(folder, tensors, self.lora, base_model=str(self.model_path))

    def _save_adapter(self, folder: Path) -> None:
        """The adapters as peft's `save_pretrained` writes them, loadable by
        `PeftModel.from_pretrained(base, folder)`; gathered over TP (and under PP the stages'
        together: adapters are small), written by rank 0."""
        assert self.lora is not None, "only a LoRA backend has adapters"
        tensors = gather_adapter_state_dict(self.model, self.layout_info)
        if self.pp > 1:
            stages = distributed.all_gather_object(tensors, group=self.groups.pp)
            tensors = {name: t for part in stages for name, t in part.items()}
        if distributed.rank() == 0:
            megatron_lora.save_peft(folder, tensors, self.lora, base_model=str(self.model_path))
        distributed.barrier()
