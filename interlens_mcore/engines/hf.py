"""A colocated Hugging Face engine: generation with the `transformers` model being trained."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .. import distributed
from .base import EngineStats, Generation, GenerationRequest, check_context
from .sampler import BatchSampling

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class HFEngine:
    """Generation with the `transformers` model being trained: left-padded batches, KV cache.

    The model is put in eval mode for the call and restored afterwards; no gradient is kept.
    With `sync_group` (an HF model under DeepSpeed ZeRO-3, whose every forward gathers
    weights across the group) the ranks take the same number of forward steps: a rank that is
    done, or called with no rows, keeps stepping a dummy row while any rank still decodes.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str = "policy"
    max_context: int = 0  # 0: the model's max_position_embeddings
    stats: EngineStats = field(default_factory=EngineStats)
    sync_group: ProcessGroup | None = None  # process group whose ranks must forward in lockstep

    def __post_init__(self) -> None:
        if not self.max_context:
            self.max_context = int(self.model.config.max_position_embeddings)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)

    def _forward(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        """The model's logits [B, T, V] of one forward step, `cache` extended."""
        t0 = time.perf_counter()
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
        self.stats.forward_s += time.perf_counter() - t0
        self.stats.forwards += 1
        return out.logits

    def _checked_caps(self, requests: Sequence[GenerationRequest], synced: bool) -> list[int]:
        """`check_context`; in lockstep every rank learns whether any rank's rows were rejected.

        A rank that raised here while the others entered the first forward's all-reduce would
        leave them waiting there, so the rejection is agreed on first and every rank raises
        (the vote then names the real cause). A failure in the middle of decoding would still
        stall the group until the collective times out: lockstep forwards share one collective.
        """
        try:
            caps, error = check_context(requests, self.max_context), None
        except ValueError as exc:
            caps, error = [], exc
        if synced:
            flag = torch.tensor([0.0 if error is None else 1.0])
            distributed.all_reduce(flag, "max", self.sync_group)
            if error is None and flag.item() > 0:
                raise ValueError(f"engine {self.name!r}: another rank's rows were rejected (see its error)")
        if error is not None:
            raise error
        return caps

    def _anyone(self, active: torch.Tensor, synced: bool) -> bool:
        """Is any row still decoding (on any rank of the sync group, when synced)?"""
        flag = torch.tensor([int(active.any())])
        if synced:
            distributed.all_reduce(flag, "max", self.sync_group)
        return bool(flag.item())

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        synced = self.sync_group is not None and distributed.world_size(self.sync_group) > 1
        if not requests and not synced:
            return []
        caps = self._checked_caps(requests, synced)
        dummy = not requests
        if dummy:  # join the group's forwards with one dummy row that samples nothing
            requests, caps = [GenerationRequest(prompt_ids=[self.pad_id], max_new_tokens=0)], [0]
        was_training = self.model.training
        self.model.eval()
        try:
            out = self._generate(requests, caps, synced)
            return [] if dummy else out
        finally:
            self.model.train(was_training)

    def _generate(
        self, requests: Sequence[GenerationRequest], caps: list[int], synced: bool
    ) -> list[Generation]:
        from transformers import DynamicCache

        device = next(self.model.parameters()).device
        b = len(requests)
        lens = [len(r.prompt_ids) for r in requests]
        width = max(lens)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding: every row's last prompt token aligns
            ids[i, width - lens[i] :] = torch.as_tensor(list(r.prompt_ids), dtype=torch.long)
            mask[i, width - lens[i] :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T] each row starts at 0
        cap_t = torch.tensor(caps)

        out_ids: list[list[int]] = [[] for _ in range(b)]
        out_lp: list[list[float]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        active = torch.tensor([c > 0 for c in caps])
        cache = DynamicCache()
        logits = self._forward(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache)[
            :, -1
        ]  # [B, V]
        sampler = BatchSampling(
            requests,
            vocab_start=0,
            vocab_width=logits.shape[-1],
            tokenizer=self.tokenizer,
            owner=f"engine {self.name!r}",
        )
        next_pos = positions[:, -1] + 1  # [B]
        step = 0
        running = self._anyone(active, synced)
        while running:
            rows = torch.nonzero(active).flatten()  # [A] only the rows still decoding sample
            picked, logp = sampler.sample(logits.float().cpu()[rows], rows, step)
            tokens = torch.full((b,), self.pad_id, dtype=torch.long).index_copy(0, rows, picked)
            for i, tok, lp in zip(rows.tolist(), picked.tolist(), logp.tolist(), strict=True):
                out_ids[i].append(tok)
                out_lp[i].append(lp)
                if sampler.record(i, tok, out_ids[i]):
                    reasons[i] = "stop"
                    active[i] = False
            step += 1
            active &= cap_t > step
            running = self._anyone(active, synced)
            if not running:
                break
            # finished rows keep decoding a pad token, masked out, so shapes stay aligned
            feed = torch.where(active, tokens, torch.full_like(tokens, self.pad_id))
            mask = torch.cat([mask, active.to(mask.dtype)[:, None].to(device)], dim=1)
            logits = self._forward(
                input_ids=feed[:, None].to(device),
                attention_mask=mask,
                position_ids=next_pos[:, None],
                cache=cache,
            )[:, -1]
            next_pos = next_pos + 1
        self.stats.generated_tokens += sum(len(x) for x in out_ids)
        return [
            Generation(token_ids=out_ids[i], logprobs=out_lp[i], finish_reason=reasons[i]) for i in range(b)
        ]
