"""A minimal colocated generation engine for a megatron-core GPTModel (CPU or GPU).

Adapter: issue 4's `MegatronEngine` was not in the tree when the trainers were written; this
one is what `MegatronGRPOTrainer` uses until it lands. It recomputes the packed prefix every
decode step (no KV cache: megatron's inference context needs CUDA), which is cheap for the
short conversations of the toy environments.

The call is collective over `group` (the rollout group: the TP ranks of one DP index): each
rank brings its own rows, the rows of the whole group are gathered, the sharded forward runs
on their union and each rank keeps its own. An idle rank joins with an empty list.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from interlens_mcore import parallel
from interlens_mcore.engine import EngineStats, Generation, GenerationRequest, check_context
from interlens_mcore.megatron import ModelLayout, forward_logits
from interlens_mcore.sampling import sample_full_vocab


@dataclass
class MegatronEngine:
    """Generation with the megatron model being trained; rows are independent of their batch."""

    model: torch.nn.Module  # the bare GPTModel (not a DDP wrapper)
    layout: ModelLayout
    name: str = "policy"
    max_context: int = 0  # 0: the layout's max_position
    group: Any = None  # rollout group whose ranks forward together
    tp_group: Any = None  # vocab shards are gathered over it before sampling
    stats: EngineStats = field(default_factory=EngineStats)

    def __post_init__(self) -> None:
        self.max_context = self.max_context or self.layout.max_position

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        parts = parallel.all_gather_object(list(requests), group=self.group)
        rows = [r for part in parts for r in part]
        if not rows:  # every rank of the group sees the same union, so all return here
            return []
        mine = sum(len(p) for p in parts[: parallel.rank(self.group)])
        was_training = self.model.training
        self.model.eval()
        try:
            out = self._decode(rows, check_context(rows, self.max_context))
        finally:
            self.model.train(was_training)
        return out[mine : mine + len(requests)]

    def _last_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        """Full-vocabulary logits [B, V] at the last token of each sequence, one packed forward."""
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)[None]  # [1, T]
        lens = torch.tensor([len(s) for s in seqs])
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
        t0 = time.perf_counter()
        logits = forward_logits(self.model, self.layout, ids, cu)  # [T, V_pad / tp]
        self.stats.forward_s += time.perf_counter() - t0
        self.stats.forwards += 1
        last = logits[(cu[1:] - 1).long()].float().cpu()  # [B, V_pad / tp]
        # the shards are tiny next to the forward; gathering them keeps sampling on one code path
        last = torch.cat(parallel.all_gather_tensor(last.contiguous(), self.tp_group), dim=-1)
        return last[:, : self.layout.vocab_size]

    def _decode(self, rows: list[GenerationRequest], caps: list[int]) -> list[Generation]:
        b = len(rows)
        seqs = [list(r.prompt_ids) for r in rows]
        out = [Generation(token_ids=[], logprobs=[], finish_reason="length") for _ in rows]
        temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32)
        seeds = torch.tensor([r.seed for r in rows], dtype=torch.int64)
        active = [c > 0 for c in caps]
        step = 0
        while any(active):
            idx = [i for i in range(b) if active[i]]
            logits = self._last_logits([seqs[i] for i in idx])
            steps = torch.full((len(idx),), step, dtype=torch.int64)
            tokens, logp = sample_full_vocab(logits, temps[idx], seeds[idx], steps)
            for j, i in enumerate(idx):
                tok = int(tokens[j])
                seqs[i].append(tok)
                out[i].token_ids.append(tok)
                out[i].logprobs.append(float(logp[j]))
                if tok in rows[i].stop_token_ids:
                    out[i].finish_reason, active[i] = "stop", False
                elif len(out[i].token_ids) >= caps[i]:
                    active[i] = False
            step += 1
        self.stats.generated_tokens += sum(len(g.token_ids) for g in out)
        return out
