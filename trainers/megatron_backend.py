"""`MegatronBackend`: a megatron-core GPTModel converted from an HF folder, TP x DP.

Placement: megatron's parallel_state splits the world into TP groups (one model shard each)
and DP groups (replicas). The rollout group is the TP group of one DP index: its ranks bring
distinct conversations to each (collective) generation call, then share their trajectories,
because a TP forward needs identical inputs on every rank of the group (the GRPO loop does
that for any backend whose groups have TP > 1).

On CPU megatron's DistributedDataParallel and optimizer need CUDA, so gradients are averaged
by torch DDP over the DP group and a torch AdamW steps; on GPU megatron's own are used.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

from interlens_mcore import parallel
from interlens_mcore.batch import TrainingBatch
from interlens_mcore.logprobs import token_logprobs, vocab_parallel_token_logprobs
from interlens_mcore.megatron import build_model, export_hf, forward_logits, load_hf_weights, load_layout
from interlens_mcore.megatron.engine import MegatronEngine
from interlens_mcore.megatron.model import vocab_start


class MegatronBackend:
    """A megatron-core model for GRPO; `parallel.init_megatron(tp)` must have run.

    `reference=True` keeps a frozen copy of the initial weights for the KL term.
    """

    layout = "packed"
    pad_to_multiple = 1
    micro_batches = None  # any number of micro-batches per step

    def __init__(
        self,
        *,
        model_path: str | Path,
        groups: parallel.ParallelGroups,
        lr: float,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        temperature: float = 1.0,
        reference: bool = False,
    ):
        self.groups, self.grad_clip, self.temperature = groups, grad_clip, temperature or 1.0
        self._frozen_engine = None  # a frozen opponent's: built on first use
        self.model_path = Path(model_path)
        self.layout_info = load_layout(self.model_path)
        self.model = build_model(self.layout_info, init_weights=False)
        load_hf_weights(self.model, self.layout_info, self.model_path)
        self.reference = self._initial_model() if reference else None
        self.train_model = self._wrap_ddp(self.model)
        self.tp_shards = tp_sharded(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.engine = MegatronEngine(self.model, self.layout_info, group=groups.rollout, tp_group=groups.tp)

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    def _initial_model(self) -> torch.nn.Module:
        # a second model from the same folder (megatron modules hold process groups: no deepcopy)
        model = build_model(self.layout_info, init_weights=False).eval().requires_grad_(False)
        load_hf_weights(model, self.layout_info, self.model_path)
        return model

    def frozen_engine(self) -> MegatronEngine:
        """The initial weights (the KL reference when there is one), generating as "frozen"."""
        if self._frozen_engine is None:
            model = self.reference if self.reference is not None else self._initial_model()
            self._frozen_engine = MegatronEngine(
                model, self.layout_info, group=self.groups.rollout, tp_group=self.groups.tp, name="frozen"
            )
        return self._frozen_engine

    def _wrap_ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.groups.dp_size == 1:
            return model
        if torch.cuda.is_available():  # megatron's DDP and optimizer need CUDA
            raise NotImplementedError("MegatronBackend: the GPU path (megatron DDP) is not wired yet")
        return torch.nn.parallel.DistributedDataParallel(model, process_group=self.groups.dp)

    def logprobs_of(self, batch: TrainingBatch, *, reference: bool = False) -> torch.Tensor:
        """[1, T] logprobs of batch.targets: the trained model's with gradient, or the reference's."""
        if batch.layout != "packed" or batch.num_tokens != batch.input_ids.shape[1]:
            raise ValueError("MegatronBackend needs packed batches without padding (pad_to_multiple=1)")
        if reference:
            with torch.no_grad():
                return self._logprobs(self.reference, batch)
        self.train_model.train()
        return self._logprobs(self.train_model, batch)

    def _logprobs(self, model: torch.nn.Module, batch: TrainingBatch) -> torch.Tensor:
        logits = forward_logits(model, self.layout_info, batch.input_ids, batch.cu_seqlens)  # [T, V_pad / tp]
        targets = batch.targets[0]  # [T]
        t = self.temperature
        if self.groups.tp_size == 1:
            lp = token_logprobs(logits, targets, temperature=t)
        else:
            lp = vocab_parallel_token_logprobs(
                logits,
                targets,
                vocab_start=vocab_start(self.layout_info),
                temperature=t,
                group=self.groups.tp,
            )
        return lp[None]  # [1, T]

    def backward(self, loss: torch.Tensor) -> None:
        # DDP averages gradients over DP, but the loss is already divided by global counts
        (loss * self.groups.dp_size).backward()

    def optimizer_step(self) -> float:
        norm = float(self.grad_norm())
        if not math.isfinite(norm):
            # every rank holds the same norm, so every rank skips: weights never diverge
            self.optimizer.zero_grad(set_to_none=True)
            return norm
        # as torch's clip_grad_norm_: scale only when over the limit, 1e-6 guards a zero norm
        scale = min(1.0, self.grad_clip / (norm + 1e-6))
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient (collective over TP), float64.

        DDP has already averaged the gradients over DP, so DP ranks agree. Under TP a shard's
        squares are summed over the TP group; a replicated parameter (a norm weight) holds the
        same gradient on every TP rank, so each rank adds 1/tp of its squares to the same sum.
        That sum also carries a NaN or inf from any one rank to all of them.
        """
        device = next(self.model.parameters()).device  # NCCL reduces device tensors only
        shard = torch.zeros((), dtype=torch.float64, device=device)
        copy = torch.zeros((), dtype=torch.float64, device=device)
        for p in self.model.parameters():
            if p.grad is None:
                continue
            sq = p.grad.detach().double().square().sum()
            if id(p) in self.tp_shards:
                shard += sq
            else:
                copy += sq
        total = shard + copy / self.groups.tp_size
        return parallel.all_reduce(total, "sum", self.groups.tp).sqrt()

    def save(self, folder: Path) -> None:
        # DP replicas are identical: one file per TP rank, written by DP rank 0
        if parallel.rank(self.groups.dp) == 0:
            tp_rank = parallel.rank(self.groups.tp)
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            torch.save(state, folder / f"model-tp{tp_rank:02d}.pt")

    def load(self, folder: Path) -> None:
        tp_rank = parallel.rank(self.groups.tp)
        state = torch.load(folder / f"model-tp{tp_rank:02d}.pt", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def export_hf(self, out_dir: str | Path) -> Path:
        """The trained weights as an HF folder (collective over the world)."""
        return export_hf(self.model, self.layout_info, self.model_path, out_dir)


def tp_sharded(model: torch.nn.Module) -> set[int]:
    """ids of the parameters that are one TP rank's slice, not a full copy.

    megatron marks slices with `tensor_model_parallel`, but only when it initialises the
    weights itself: with `build_model(init_weights=False)` the weights of its parallel layers
    stay unmarked, so the layer type decides for those (a row-parallel bias is a full copy).
    """
    out = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            by_layer = isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) or (
                isinstance(module, RowParallelLinear) and name == "weight"
            )
            if by_layer or getattr(p, "tensor_model_parallel", False):
                out.add(id(p))
    return out
