"""What a GPTModel trains with: the DP wrapper, the optimizer and one step, on GPU or on CPU.

One seam, two paths, chosen by `choose_path`:

- "megatron" (CUDA): megatron-core's `DistributedDataParallel` (gradients reduced in fp32 in
  its contiguous buffers, optional overlap of the reduce with backward) and
  `get_megatron_optimizer` (Adam with decoupled weight decay, bf16 parameters with fp32 main
  weights and gradients, the distributed optimizer sharding those over DP, gradient clipping).
  A constant loss scale of 1 turns on megatron's own check for inf / NaN gradients, which
  skips the update on every rank together; bf16 needs no real scaling.
- "torch" (CPU, where megatron's DDP and optimizers need CUDA): torch DDP over the DP group
  and a torch AdamW, with the same clipping and the same skip of a non-finite step.

Both average gradients over DP, so the caller's loss (already divided by global token counts)
is multiplied by the DP size in `backward`. Example::

    training = build_training(model, TrainingOptions(lr=1e-5), groups)
    loss = grpo_loss(forward_logits(training.train_model, ...))
    training.backward(loss)
    grad_norm = training.step()  # NaN or inf: the update was skipped everywhere
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

import torch

from .. import distributed

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from torch.distributed import ProcessGroup

TrainingPath = Literal["megatron", "torch"]


@dataclass(frozen=True, kw_only=True)
class TrainingOptions:
    """Optimizer and gradient-reduction settings (the ones a GRPO run sets)."""

    lr: float
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global 2-norm of the gradient
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    bf16: bool = True  # megatron path: bf16 parameters, fp32 main weights (CPU trains in fp32)
    distributed_optimizer: bool = True  # megatron path: main weights and Adam state sharded over DP
    overlap_grad_reduce: bool = False  # megatron path: reduce buckets while backward runs
    overlap_param_gather: bool = False  # megatron path: gather updated weights in the next forward
    sequence_parallel: bool = False  # megatron path with TP > 1; token counts must divide by TP
    recompute: bool = False  # activation checkpointing of every transformer layer

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"TrainingOptions.lr must be > 0, got {self.lr}")
        if not self.grad_clip > 0:
            raise ValueError(f"TrainingOptions.grad_clip must be > 0, got {self.grad_clip}")
        if self.overlap_param_gather and not self.distributed_optimizer:
            raise ValueError("TrainingOptions.overlap_param_gather needs distributed_optimizer=True")
        if self.overlap_param_gather:
            # the colocated engine generates right after the step, through the bare model,
            # outside the DDP forward hooks that would finish the gather
            raise ValueError(
                "TrainingOptions.overlap_param_gather is not supported with a colocated engine "
                "(the engine needs the updated weights gathered before it generates)"
            )


def choose_path(cuda: bool | None = None) -> TrainingPath:
    """ "megatron" where CUDA is available, else "torch"."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    return "megatron" if cuda else "torch"


def model_overrides(options: TrainingOptions, *, path: TrainingPath, tp_size: int) -> dict:
    """TransformerConfig overrides (for `build_model(**overrides)`) of the training path."""
    if path == "torch":
        return {}
    dtype = torch.bfloat16 if options.bf16 else torch.float32
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {
        "bf16": options.bf16,
        "params_dtype": dtype,
        "sequence_parallel": options.sequence_parallel and tp_size > 1,
        **(recompute if options.recompute else {}),
    }


def recompute_layers(model: torch.nn.Module) -> None:
    """Activation checkpointing on the "torch" path: each transformer layer's forward with
    gradient runs under torch's non-reentrant `checkpoint`, which keeps the layer's input and
    recomputes the rest in the backward. megatron's own recompute (the "megatron" path, through
    `model_overrides`) saves and restores CUDA RNG states, so it needs CUDA. Forwards without
    gradient (the engine's, the reference's) run as they are."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.utils.checkpoint import checkpoint

    for layer in model.modules():
        if isinstance(layer, TransformerLayer):
            layer.forward = _checkpointed(layer, layer.forward, checkpoint)


def _checkpointed(layer: torch.nn.Module, forward, checkpoint):
    def run(*args, **kwargs):
        if not (torch.is_grad_enabled() and layer.training):
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def ddp_config(options: TrainingOptions):
    """megatron's DistributedDataParallelConfig of `options`."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,  # bf16 sums of many ranks lose the small updates
        overlap_grad_reduce=options.overlap_grad_reduce,
        overlap_param_gather=options.overlap_param_gather,
        use_distributed_optimizer=options.distributed_optimizer,
        # a non-finite gradient is a skipped step (counted), not an exception
        check_for_nan_in_grad=False,
    )


def optimizer_config(options: TrainingOptions):
    """megatron's OptimizerConfig of `options`: Adam(W), bf16 with fp32 main weights, clipping."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=options.lr,
        weight_decay=options.weight_decay,
        decoupled_weight_decay=True,  # AdamW, as the CPU path
        adam_beta1=options.adam_betas[0],
        adam_beta2=options.adam_betas[1],
        adam_eps=options.adam_eps,
        bf16=options.bf16,
        params_dtype=torch.bfloat16 if options.bf16 else torch.float32,
        main_params_dtype=torch.float32,
        main_grads_dtype=torch.float32,
        use_distributed_optimizer=options.distributed_optimizer,
        overlap_param_gather=options.overlap_param_gather,
        clip_grad=options.grad_clip,
        # a constant scale of 1 changes no number but turns on the inf / NaN check and skip
        loss_scale=1.0,
    )


@dataclass
class Training:
    """The model as trained: `train_model` for forwards with gradient, `model` for the engine."""

    path: TrainingPath
    model: torch.nn.Module  # the bare GPTModel (weights shared with the engine)
    train_model: torch.nn.Module  # the DP wrapper (or `model` when DP is 1 on CPU)
    optimizer: torch.optim.Optimizer | MegatronOptimizer  # AdamW ("torch") or megatron's ("megatron")
    dp_size: int
    tp_group: ProcessGroup | None = None
    tp_shards: frozenset[int] = frozenset()  # ids of TP-sliced parameters ("torch" path)
    grad_clip: float = 1.0
    # pipeline parallelism ("torch" path): no DDP wrapper (megatron's schedule runs the stage's
    # backward itself); `step` sums the gradients over `dp_group` and the norm over `pp_group`,
    # counting the last stage's copy of a tied embedding (`tied_copy`) once
    pp_group: ProcessGroup | None = None
    dp_group: ProcessGroup | None = None
    tied_copy: int | None = None  # id of the last stage's output weight when it is the embedding

    def backward(self, loss: torch.Tensor) -> None:
        # DDP averages over DP, but the loss is already divided by global counts
        # (under PP megatron's schedule runs the backward, and `step` sums over DP instead)
        loss = loss * self.dp_size
        if self.path == "megatron":
            # a CUDA tensor; the loss may come from the CPU
            scale = self._megatron_optimizer().get_loss_scale()
            loss = loss.to(scale.device) * scale
        loss.backward()

    def step(self) -> float:
        """Clip, step, zero the gradients; the global gradient norm (NaN / inf: skipped)."""
        if self.path == "megatron":
            return self._megatron_step()
        if self.pp_group is not None and self.dp_size > 1:
            # what DDP does at PP=1, after the schedule: the sum over DP of losses already divided
            # by global token counts (the schedule's loss is not multiplied by the DP size)
            for p in self.model.parameters():
                if p.grad is not None:
                    distributed.all_reduce(p.grad, "sum", self.dp_group)
        norm = float(self.grad_norm())
        if math.isfinite(norm):
            # as torch's clip_grad_norm_: scale only when over the limit, 1e-6 guards a zero norm
            scale = min(1.0, self.grad_clip / (norm + 1e-6))
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
            self.optimizer.step()
        # else every rank holds the same norm, so every rank skips: weights never diverge
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _megatron_optimizer(self) -> MegatronOptimizer:
        # build_training makes megatron's optimizer on this path (torch's AdamW on the other)
        return cast("MegatronOptimizer", self.optimizer)

    def _megatron_step(self) -> float:
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

        ddp = self.train_model
        assert isinstance(ddp, DistributedDataParallel), "build_training wraps megatron's DDP on this path"
        # DP reduce of the grad buffers (waits for overlapped buckets), and the TP all-reduce
        # of norm gradients that sequence parallelism leaves partial
        finalize_model_grads([ddp])
        optimizer = self._megatron_optimizer()
        applied, norm, _ = optimizer.step()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        return float(norm) if applied else math.nan

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient ("torch" path; collective over TP), float64.

        DDP has already averaged over DP, so DP ranks agree. A TP slice's squares are summed
        over the TP group; a replicated parameter (a norm weight) holds the same gradient on
        every TP rank, so each rank adds 1/tp of its squares. The sum also carries a NaN or inf
        from any one rank to all of them.
        """
        device = next(self.model.parameters()).device
        shard = torch.zeros((), dtype=torch.float64, device=device)
        copy = torch.zeros((), dtype=torch.float64, device=device)
        for p in self.model.parameters():
            if p.grad is None or id(p) == self.tied_copy:
                continue
            sq = p.grad.detach().double().square().sum()
            if id(p) in self.tp_shards:
                shard += sq
            else:
                copy += sq
        tp = distributed.world_size(self.tp_group)
        total = distributed.all_reduce(shard + copy / tp, "sum", self.tp_group)
        if self.pp_group is not None:  # each stage holds its own layers
            total = distributed.all_reduce(total, "sum", self.pp_group)
        return total.sqrt()


def tp_sharded(model: torch.nn.Module) -> frozenset[int]:
    """ids of the parameters that are one TP rank's slice, not a full copy.

    megatron marks slices with `tensor_model_parallel` only when it initialises the weights
    itself; with `build_model(init_weights=False)` the layer type decides (a row-parallel
    bias is a full copy).
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    out = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            by_layer = isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) or (
                isinstance(module, RowParallelLinear) and name == "weight"
            )
            if by_layer or getattr(p, "tensor_model_parallel", False):
                out.add(id(p))
    return frozenset(out)


def build_training(
    model: torch.nn.Module,
    options: TrainingOptions,
    groups: distributed.ParallelGroups,
    *,
    path: TrainingPath | None = None,
) -> Training:
    """Wrap `model` (the bare GPTModel, already on its device) for training on `path`.

    "megatron" needs the model built with `model_overrides(options, path="megatron", ...)`
    and moved to the GPU.
    """
    path = path or choose_path()
    if path == "megatron":
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import get_megatron_optimizer

        wrapped = DistributedDataParallel(config=model.config, ddp_config=ddp_config(options), module=model)
        optimizer = get_megatron_optimizer(optimizer_config(options), [wrapped])
        return Training(
            path=path, model=model, train_model=wrapped, optimizer=optimizer, dp_size=groups.dp_size
        )
    if options.recompute:
        recompute_layers(model)
    from .stages import pipeline_size, stage

    pipelined = pipeline_size() > 1
    wrapped = model
    if groups.dp_size > 1 and not pipelined:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=groups.dp)
    tied_copy = None
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    if pipelined and tied and stage() == (False, True):
        tied_copy = id(model.shared_embedding_or_output_weight())  # type: ignore[operator]
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],  # with LoRA: the adapters alone
        lr=options.lr,
        weight_decay=options.weight_decay,
        betas=options.adam_betas,
        eps=options.adam_eps,
    )
    return Training(
        path=path,
        model=model,
        train_model=wrapped,
        optimizer=optimizer,
        dp_size=groups.dp_size,
        tp_group=groups.tp if groups.tp is not None else distributed.megatron_tp_group(),
        tp_shards=tp_sharded(model),
        grad_clip=options.grad_clip,
        pp_group=groups.pp if pipelined else None,
        dp_group=groups.dp,
        tied_copy=tied_copy,
    )
