"""Generation with the megatron-core GPTModel being trained (colocated), under tensor parallelism.

A generate call is collective over the rollout group: every rank passes its own requests (an
idle rank passes none but still calls), the ranks gather them, run the same TP-sharded forward
on the union and each keeps its own rows. The rollout group must contain whole TP groups (the
TP group itself, or TP x PP x CP ranks sharing a DP index) so that every rank of a TP group
runs the forward on identical inputs.

Sampling never gathers the vocabulary: each TP rank perturbs its logit shard with the
counter-based Gumbel noise of `sampling.gumbel_noise` (the noise of a token depends only on
the row's seed, the step and the token id), takes its local maximum, and one max all-reduce
picks the token, so TP=2 samples exactly what TP=1 samples for the same seeds. Top-k and
top-p thresholds come from per-shard candidates (engines/sampler.py); logprobs from a vocab-parallel
log-sum-exp over the tokens the filters kept. Stop strings need `tokenizer`.

With the CPU layer spec (`SDPACoreAttention` applying RoPE itself) the engine keeps a
key/value cache (kv_cache.py): one packed prefill of the prompts, then one token per active
row per step. Across calls it keeps each tagged row's keys/values (`PrefixStore`: under
`co_step` the tag is the conversation id), so a conversation's next turn prefills only what was
appended since its last one: the other speakers' messages and the new generation prompt. The
store is cleared whenever the weights change (the parameters' in-place version counters or
storages moved, or `clear()`), and checked by content, so a reused key is always the key the
full prefill would compute, up to float rounding of a shorter matmul.

Under pipeline parallelism (`init_megatron(tp, pp=...)`, the rollout group the model-parallel
group) each forward goes stage to stage (`pipeline.forward_stages`: the activations sent and
received, their shape known from the fed tokens); the last stage samples over its TP group and
broadcasts the ids and logprobs to the other stages, so every stage's cache advances with the
same tokens and PP=2 samples what one rank samples for the same seeds.

With megatron's own attention and rotary embedding (the GPU specs) there is no cache to
attach (nor kept prefixes), and each step recomputes the packed batch of active rows from scratch: O(sum
of lengths) forward work per token instead of O(rows), acceptable for short turns; megatron's
CUDA inference contexts are the way to go further there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .. import distributed
from ..engines.base import EngineStats, Generation, GenerationRequest, check_context
from ..engines.prefix_cache import ReuseStats
from ..engines.sampler import BatchSampling, Filters, VocabShard, sample
from .kv_cache import KVCache, PrefixStore, attached, supports_kv_cache
from .model import ModelLayout, forward_logits, vocab_start
from .pipeline import forward_stages, sampled_from_last_stage
from .stages import pipeline_size

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PreTrainedTokenizerBase


def vocab_shard(
    start: int, group: ProcessGroup | None = None, comm_device: torch.device | None = None
) -> VocabShard:
    """The `VocabShard` of this TP rank: collectives over `group`, reduced on `comm_device`.

    comm_device: where the group reduces (a CUDA device for NCCL groups; default: CPU).
    """

    def reduce(x: torch.Tensor, op: str) -> torch.Tensor:
        return distributed.all_reduce(x.to(comm_device or x.device), op, group).to(x.device)

    def gather(x: torch.Tensor) -> list[torch.Tensor]:
        return [y.to(x.device) for y in distributed.all_gather_tensor(x.to(comm_device or x.device), group)]

    return VocabShard(start=start, reduce=reduce, gather=gather)


def sample_vocab_parallel(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    start: int,
    group: ProcessGroup | None = None,
    comm_device: torch.device | None = None,
    filters: Filters | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from vocab-sharded logits; collective over the TP `group`.

    logits: [B, V_local] (CPU) for global ids [start, start + V_local), padded ids already
    -inf. Returns (token ids [B], logprobs [B]) identical on every rank, with the semantics of
    `sampling.sample` (filters included, computed from per-shard candidates).
    """
    return sample(logits, temperatures, seeds, steps, filters, vocab_shard(start, group, comm_device))


# the most logits one generation forward may hold ([T, V_local] floats: 512 MB in float32)
LOGITS_BUDGET = 1 << 27


@dataclass
class MegatronEngine:
    """The Engine protocol over a megatron GPTModel; `generate` is collective over `group`.

    Example (on every rank of the rollout group, here the TP group)::

        engine = MegatronEngine(model, layout, group=distributed.megatron_tp_group())
        outs = engine.generate(my_requests)  # [] on an idle rank, while any rank works
    """

    model: torch.nn.Module  # the bare GPTModel (this rank's TP shard)
    layout: ModelLayout
    # the rollout group (None: the world); must contain whole TP groups
    group: ProcessGroup | None = None
    # the model's TP group (None: megatron's), for vocab-parallel sampling
    tp_group: ProcessGroup | None = None
    name: str = "policy"
    max_context: int = 0  # 0: the layout's max_position
    use_kv_cache: bool = True  # where the model supports it (CPU spec); else full recompute
    stats: EngineStats = field(default_factory=EngineStats)
    # decodes sampled ids for stop strings (requests with `stop` need one)
    tokenizer: PreTrainedTokenizerBase | None = None
    compute_dtype: torch.dtype | None = None  # autocast dtype of the forward (None: the weights')
    # keys/values kept across calls for a tag's next turn (with the KV cache); 0 turns it off
    prefix_bytes: int = 2 << 30
    reuse: ReuseStats = field(default_factory=ReuseStats)

    def __post_init__(self) -> None:
        if not self.max_context:
            self.max_context = self.layout.max_position
        if self.tp_group is None:
            self.tp_group = distributed.megatron_tp_group()
        self.prefixes = PrefixStore(self.prefix_bytes)
        self._weights: tuple[tuple[int, int], ...] = ()

    def clear(self) -> None:
        """Forget the keys/values kept across calls (they belong to the weights that made them)."""
        self.prefixes.clear()

    def _weights_fingerprint(self) -> tuple[tuple[int, int], ...]:
        # an in-place update (optimizer step, load, lerp) bumps a parameter's version counter
        return tuple((p._version, p.data_ptr()) for p in self.model.parameters())

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        mine = list(requests)
        per_rank = distributed.all_gather_object(mine, self.group)
        union = [r for rank_requests in per_rank for r in rank_requests]
        offset = sum(len(x) for x in per_rank[: distributed.rank(self.group)])
        if not union:
            return []
        # validated on the union, so every rank raises the same error instead of some hanging
        caps = check_context(union, self.max_context)
        was_training = self.model.training
        self.model.eval()
        try:
            if self.use_kv_cache and supports_kv_cache(self.model):
                longest = max(len(r.prompt_ids) + c for r, c in zip(union, caps, strict=True))
                with attached(self.model, KVCache(len(union), longest)) as cache:
                    self._seed(union, caps, cache)
                    outs = self._generate(union, caps, cache)
            else:
                outs = self._generate(union, caps, None)
        finally:
            self.model.train(was_training)
        outs = outs[offset : offset + len(mine)]
        self.stats.generated_tokens += sum(len(g.token_ids) for g in outs)
        return outs

    def _seed(self, requests: list[GenerationRequest], caps: list[int], cache: KVCache) -> None:
        """Put each tagged row's kept prefix in its cache row (nothing when the weights moved)."""
        weights = self._weights_fingerprint()
        if weights != self._weights:
            self.prefixes.clear()
            self._weights = weights
        for i, (r, cap) in enumerate(zip(requests, caps, strict=True)):
            if cap <= 0:
                continue
            kept, n = self.prefixes.lookup(r.tag, r.prompt_ids) if self.prefix_bytes > 0 else (None, 0)
            if kept is not None:
                cache.seed(i, kept.kv, n)
            self.reuse.reused_tokens += n
            self.reuse.prefill_tokens += len(r.prompt_ids) - n

    def _keep(self, requests: list[GenerationRequest], seqs: list[list[int]], cache: KVCache) -> None:
        """Keep every tagged row's fed tokens (prompt and all but the last sampled id)."""
        if self.prefix_bytes <= 0:
            return
        for i, r in enumerate(requests):
            n = int(cache.lengths[i])
            if r.tag and n:
                self.prefixes.keep(r.tag, seqs[i][:n], cache.export(i))

    def _forward_last(
        self, seqs: list[list[int]], cache: KVCache | None, rows: list[int] | None = None
    ) -> torch.Tensor | None:
        """Logits shard [B, V_local] at the last token of each sequence (packed forwards); under
        pipeline parallelism on the last stage only (None on the others).

        A forward's logits cover every token it feeds ([T, V_local] in float32), so a long
        prefill of many conversations is fed in chunks of whole sequences of at most
        `LOGITS_BUDGET` logits each: 16 conversations of 2,000 tokens with a 49k vocabulary would
        otherwise take 6 GB for logits of which 16 rows are read. `rows` are the cache rows the
        sequences feed (with a cache). The chunks depend only on the lengths, alike on every TP rank.
        """
        per_token = max(1, self.layout.vocab_per_rank)
        chunks: list[list[int]] = [[]]  # indices into seqs
        size = 0
        for i, s in enumerate(seqs):
            if chunks[-1] and (size + len(s)) * per_token > LOGITS_BUDGET:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += len(s)
        out = []
        for chunk in chunks:
            if cache is not None:
                assert rows is not None, "the cache rows the sequences feed"
                cache.select([rows[i] for i in chunk])
            out.append(self._forward_chunk([seqs[i] for i in chunk], cache))
        return None if any(x is None for x in out) else torch.cat([x for x in out if x is not None])

    def _forward_chunk(self, seqs: list[list[int]], cache: KVCache | None) -> torch.Tensor | None:
        lengths = torch.tensor([len(s) for s in seqs])
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        ids = torch.tensor([[t for s in seqs for t in s]], dtype=torch.long)  # [1, T]
        t0 = time.perf_counter()
        logits: torch.Tensor | None
        if pipeline_size() > 1:  # the last stage's logits; None on the others
            logits = forward_stages(self.model, self.layout, ids, cu, compute_dtype=self.compute_dtype)
        else:
            logits = forward_logits(self.model, self.layout, ids, cu, compute_dtype=self.compute_dtype)
        if cache is not None:
            cache.advance(cu)
        self.stats.forward_s += time.perf_counter() - t0
        self.stats.forwards += 1
        return logits[cu[1:].long() - 1].float().cpu() if logits is not None else None

    def _generate(
        self, requests: list[GenerationRequest], caps: list[int], cache: KVCache | None
    ) -> list[Generation]:
        b = len(requests)
        seqs = [list(r.prompt_ids) for r in requests]
        out_ids: list[list[int]] = [[] for _ in range(b)]
        out_lp: list[list[float]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        active = [i for i in range(b) if caps[i] > 0]
        start = vocab_start(self.layout)
        device = next(self.model.parameters()).device  # the TP group's backend reduces there
        shard = vocab_shard(start, self.tp_group, device)
        sampler: BatchSampling | None = None  # built at the first logits, which give the shard width
        step = 0
        while active:
            if cache is None:  # recompute every active row from its first token
                logits = self._forward_last([seqs[i] for i in active], None)
            else:  # the prompts once (after any kept prefix), then each row's newest token
                fed = [seqs[i][-1:] if step else seqs[i][int(cache.lengths[i]) :] for i in active]
                logits = self._forward_last(fed, cache, active)
            if sampler is None:
                sampler = BatchSampling(
                    requests,
                    vocab_start=start,
                    vocab_width=self.layout.vocab_per_rank,
                    tokenizer=self.tokenizer,
                    owner=f"engine {self.name!r}",
                )
            tokens = logp = None
            if logits is not None:  # the last pipeline stage samples (over its TP group)
                tokens, logp = sampler.sample(logits, torch.tensor(active), step, shard)
            if pipeline_size() > 1:  # and every stage feeds the same ids next
                tokens, logp = sampled_from_last_stage(tokens, logp, len(active))
            assert tokens is not None and logp is not None
            still = []
            for i, tok, lp in zip(active, tokens.tolist(), logp.tolist(), strict=True):
                out_ids[i].append(tok)
                out_lp[i].append(lp)
                seqs[i].append(tok)
                if sampler.record(i, tok, out_ids[i]):
                    reasons[i] = "stop"
                elif len(out_ids[i]) < caps[i]:
                    still.append(i)
            active = still
            step += 1
        if cache is not None:
            self._keep(requests, seqs, cache)
        return [
            Generation(token_ids=out_ids[i], logprobs=out_lp[i], finish_reason=reasons[i]) for i in range(b)
        ]
