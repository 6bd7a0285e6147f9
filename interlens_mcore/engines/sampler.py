"""Counter-based sampling: the noise for (seed, step, token) is a pure function of those three.

A row's tokens therefore never depend on its batch, its wave, its neighbours or how the
vocabulary is sharded: a tensor-parallel rank computes the noise of its own vocabulary slice
and the Gumbel-max argmax over the shards equals the one over the full vocabulary.

The filters and penalties have vLLM's meanings and order: penalties on the raw logits
(repetition over prompt and output tokens, presence and frequency over output tokens), then
temperature, then min-p, top-k and top-p, then a sample from what is left. Each filter keeps
the tokens at or above a threshold, ties included, and every threshold is computed exactly
the same way however the vocabulary is split: top-k from per-shard top-k candidates, top-p
from per-shard candidates of fixed-point probabilities (integer sums do not depend on their
order), so TP=2 keeps the same tokens as TP=1 without gathering the vocabulary.

The logprob of a sampled token is taken under the distribution it was drawn from: penalised,
temperature-scaled, filtered and renormalised (vLLM's `processed_logprobs`). That is the
behaviour policy an importance-sampling correction divides by. Greedy rows (T == 0) ignore the
filters, as in vLLM, and report the logprob under the penalised logits at temperature 1.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .base import GenerationRequest

_MASK64 = (1 << 64) - 1


def _as_int64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    # logical right shift on int64 (torch's >> is arithmetic)
    return (z >> k) & ((1 << (64 - k)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    z = z + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def text_seed(text: str) -> int:
    """A 64-bit seed from text (e.g. a conversation id), the same in every process.

    blake2b, not crc32: with 32 bits, ids such as "plumless" and "buckeroo" share a seed (and
    sample the same tokens); `mix_seed` folds all 64 bits in.
    """
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big"
    )


def mix_seed(*parts: int) -> int:
    """Fold integers into one 63-bit seed (deterministic across processes, unlike hash())."""
    z = torch.tensor(0, dtype=torch.int64)
    for p in parts:
        z = splitmix64(z ^ torch.tensor(_as_int64(int(p)), dtype=torch.int64))
    return int(z) & ((1 << 63) - 1)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_start: int, vocab_end: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, vocab_end - vocab_start] for rows with `seeds` [B] at `steps` [B]."""
    row = splitmix64(seeds.to(torch.int64) ^ splitmix64(steps.to(torch.int64)))  # [B]
    z = splitmix64(row[:, None] ^ _vocab_keys(vocab_start, vocab_end)[None, :])  # [B, V]
    # top 24 bits -> uniform in (0, 1), never exactly 0 or 1, so both logs stay finite
    # (24 bits are exact in float32)
    u = (_shr(z, 40).to(torch.float32) + 0.5) / float(1 << 24)
    return -torch.log(-torch.log(u))


@functools.lru_cache(maxsize=16)
def _vocab_keys(vocab_start: int, vocab_end: int) -> torch.Tensor:
    # the per-token half of the hash is the same every step: compute it once per shard
    return splitmix64(torch.arange(vocab_start, vocab_end, dtype=torch.int64) + 0x5A5A)  # [V]


def perturbed_scores(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    vocab_start: int = 0,
) -> torch.Tensor:
    """Scores whose argmax is a sample from softmax(logits / T); greedy rows (T == 0) get no noise.

    logits: [B, V_local] float32 (the local vocabulary shard); returns [B, V_local].
    """
    greedy = temperatures <= 0
    scores = _scaled(logits, temperatures)
    noise = gumbel_noise(seeds, steps, vocab_start, vocab_start + logits.shape[-1])
    return torch.where(greedy[:, None], scores, scores + noise)


def _scaled(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    t = torch.where(temperatures <= 0, torch.ones_like(temperatures), temperatures)
    return logits.float() / t[:, None]


def _local_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    return x


def _local_gather(x: torch.Tensor) -> list[torch.Tensor]:
    return [x]


@dataclass(frozen=True)
class VocabShard:
    """Where a logits shard sits in the vocabulary and how its group combines results.

    `reduce(x, op)` all-reduces ('max', 'min' or 'sum') over the shards; `gather(x)` returns
    every shard's `x` (same shape everywhere) in shard order. The defaults: one full shard.
    """

    start: int = 0
    reduce: Callable[[torch.Tensor, str], torch.Tensor] = _local_reduce
    gather: Callable[[torch.Tensor], list[torch.Tensor]] = _local_gather


FULL_VOCAB = VocabShard()

# top-p weighs tokens in fixed point: w * 2**32 with w <= 1, so a row's sum over a vocabulary of
# up to 2**20 tokens stays below 2**52 and every partial sum is exact in int64 and float64
_FIXED_ONE = float(1 << 32)


@dataclass(frozen=True)
class Filters:
    """Per-row filter settings [B], vLLM's meanings; None where no row of the batch uses one."""

    top_p: torch.Tensor | None = None  # [B] float64 in (0, 1]; 1 keeps every token
    top_k: torch.Tensor | None = None  # [B] int64; 0 keeps every token
    min_p: torch.Tensor | None = None  # [B] float32 in [0, 1]; 0 keeps every token

    def select(self, rows: torch.Tensor) -> Filters:
        """The settings of `rows` [A] (indices into the batch)."""
        pick = lambda x: None if x is None else x[rows]
        return Filters(top_p=pick(self.top_p), top_k=pick(self.top_k), min_p=pick(self.min_p))

    @property
    def active(self) -> bool:
        return any(x is not None for x in (self.top_p, self.top_k, self.min_p))


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    filters: Filters | None = None,
    shard: VocabShard = FULL_VOCAB,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from (possibly vocab-sharded) logits [B, V_local].

    The logits are already penalised (`apply_penalties`); ids outside the real vocabulary are
    -inf. Returns (token ids [B], logprob of each under the distribution sampled from [B]),
    identical on every shard. Collective over the shard group when it has several shards.
    """
    greedy = temperatures <= 0
    scaled = _scaled(logits, temperatures)  # [B, V_local]
    row_max = shard.reduce(scaled.max(dim=-1).values, "max")  # [B]
    keep = _kept(scaled, row_max, greedy, filters, shard) if filters and filters.active else None
    noise = gumbel_noise(seeds, steps, shard.start, shard.start + logits.shape[-1])
    scores = torch.where(greedy[:, None], scaled, scaled + noise)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    local_best, local_idx = scores.max(dim=-1)  # first index on ties within the shard
    best = shard.reduce(local_best.clone(), "max")
    # ties across shards go to the lowest global id, as argmax over the full vocabulary does
    no_claim = torch.full_like(local_idx, torch.iinfo(torch.int64).max)
    tokens = shard.reduce(torch.where(local_best == best, local_idx + shard.start, no_claim), "min")

    return tokens, _logprobs(scaled, row_max, keep, tokens, shard)


def processed_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperatures: torch.Tensor,
    filters: Filters | None = None,
    shard: VocabShard = FULL_VOCAB,
) -> torch.Tensor:
    """Logprob [B] of given `tokens` [B] under the distribution `sample` draws from (rescoring).

    -inf where a filter removed the token. logits: [B, V_local], already penalised.
    """
    greedy = temperatures <= 0
    scaled = _scaled(logits, temperatures)
    row_max = shard.reduce(scaled.max(dim=-1).values, "max")
    keep = _kept(scaled, row_max, greedy, filters, shard) if filters and filters.active else None
    return _logprobs(scaled, row_max, keep, tokens, shard)


def _logprobs(
    scaled: torch.Tensor,
    row_max: torch.Tensor,
    keep: torch.Tensor | None,
    tokens: torch.Tensor,
    shard: VocabShard,
) -> torch.Tensor:
    """log softmax over the kept tokens, at `tokens` [B]; a vocab-parallel log-sum-exp."""
    width = scaled.shape[-1]
    weights = (scaled - row_max[:, None]).exp()  # [B, V_local]
    owned = (tokens >= shard.start) & (tokens < shard.start + width)
    local = (tokens - shard.start).clamp(0, width - 1)[:, None]
    picked = scaled.gather(-1, local).squeeze(-1)
    if keep is not None:
        weights = torch.where(keep, weights, 0.0)
        picked = torch.where(keep.gather(-1, local).squeeze(-1), picked, float("-inf"))
    sums = shard.reduce(torch.stack([weights.sum(-1), torch.where(owned, picked, 0.0)]), "sum")  # [2, B]
    return sums[1] - row_max - sums[0].log()


def sample_full_vocab(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    filters: Filters | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` on full-vocabulary logits [B, V] (one shard)."""
    return sample(logits, temperatures, seeds, steps, filters)


def _kept(
    scaled: torch.Tensor, row_max: torch.Tensor, greedy: torch.Tensor, filters: Filters, shard: VocabShard
) -> torch.Tensor:
    """Which tokens of the shard survive min-p, top-k and top-p [B, V_local] (bool)."""
    # the row's most likely token has weight 1: weights are probabilities over the max probability
    weights = (scaled - row_max[:, None]).exp()  # [B, V_local] in [0, 1]
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if filters.min_p is not None:
        keep &= weights >= filters.min_p[:, None]
    if filters.top_k is not None:
        keep &= scaled >= _kth_largest(scaled, filters.top_k, shard)[:, None]
    if filters.top_p is not None:
        # after min-p and top-k, as in vLLM: the mass is that of the renormalised survivors
        keep &= _top_p_kept(torch.where(keep, weights, 0.0), filters.top_p, shard)
    return keep | greedy[:, None]


def _kth_largest(scaled: torch.Tensor, k: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The k-th largest score of each row [B] over all shards (-inf where k == 0 or k > V)."""
    kmax = int(k.max())
    if kmax == 0:
        return torch.full_like(scaled[:, 0], float("-inf"))
    local = scaled.topk(min(kmax, scaled.shape[-1]), dim=-1).values  # [B, <= kmax]
    local = torch.nn.functional.pad(local, (0, kmax - local.shape[-1]), value=float("-inf"))
    # the k largest of the vocabulary are among the union of every shard's k largest
    merged = torch.cat(shard.gather(local), dim=-1).topk(kmax, dim=-1).values  # [B, kmax]
    kth = merged.gather(-1, (k - 1).clamp(min=0)[:, None]).squeeze(-1)
    return torch.where(k > 0, kth, float("-inf"))


def _top_p_kept(weights: torch.Tensor, top_p: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Tokens inside the top-p nucleus [B, V_local]: those whose more likely tokens hold < p of the mass.

    weights: [B, V_local] unnormalised probabilities in [0, 1], 0 for filtered tokens.
    """
    fixed = (weights.double() * _FIXED_ONE).floor().to(torch.int64)  # [B, V_local]
    target = top_p.double() * shard.reduce(fixed.sum(-1), "sum").double()  # [B]
    # rows without top-p keep everything below; a zero target keeps their candidate lists short
    target = torch.where(top_p >= 1, 0.0, target)
    ranked = fixed.sort(dim=-1, descending=True).values
    local_tau = _nucleus_floor(ranked, target)
    # a token below its shard's floor already has >= p of the mass above it on that shard alone,
    # so each shard's candidates are the tokens at or above its floor
    count = int(shard.reduce((ranked >= local_tau[:, None]).sum(-1).max().reshape(1), "max"))
    merged = torch.cat(shard.gather(ranked[:, :count].contiguous()), dim=-1)
    tau = _nucleus_floor(merged.sort(dim=-1, descending=True).values, target)
    return (fixed >= tau[:, None]) | (top_p >= 1)[:, None]


def _nucleus_floor(ranked: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Smallest weight [B] whose strictly heavier tokens weigh less than `target` (ranked: descending)."""
    before = ranked.cumsum(-1) - ranked  # [B, n] the mass ranked before each token (exact integers)
    n = (before.double() < target[:, None]).sum(-1).clamp(min=1)
    return ranked.gather(-1, (n - 1)[:, None]).squeeze(-1)


def apply_penalties(
    logits: torch.Tensor,
    prompt_seen: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on raw logits [B, V_local]; returns new logits.

    prompt_seen: [B, V_local] bool, the token occurs in the row's prompt; output_counts:
    [B, V_local] how often it was sampled this turn; repetition, presence, frequency: [B].
    Repetition divides positive logits (multiplies negative ones) of every token seen in the
    prompt or the output; presence subtracts once per token sampled, frequency per occurrence.
    """
    sampled = output_counts > 0
    r = torch.where(prompt_seen | sampled, repetition[:, None], torch.ones_like(logits))
    out = torch.where(logits > 0, logits / r, logits * r)
    return out - frequency[:, None] * output_counts - presence[:, None] * sampled


class BatchSampling:
    """Sampling state of one generate call: per-row settings, penalty counts, stop checks.

    Rows are the call's requests in order; `sample` takes the logits of a subset of them (the
    rows still decoding) over this rank's vocabulary shard, `record` books a sampled token and
    says whether the row stopped (a stop id, or a stop string in its decoded text).
    """

    def __init__(
        self,
        requests: Sequence[GenerationRequest],
        *,
        vocab_start: int,
        vocab_width: int,
        tokenizer: PreTrainedTokenizerBase | None = None,
        owner: str = "engine",
    ) -> None:
        self.temperatures = torch.tensor([r.temperature for r in requests], dtype=torch.float32)
        self.seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64)
        sampled = [r.temperature > 0 for r in requests]
        self.filters = Filters(
            top_p=_column(requests, sampled, "top_p", 1.0, torch.float64),
            top_k=_column(requests, sampled, "top_k", 0, torch.int64),
            min_p=_column(requests, sampled, "min_p", 0.0, torch.float32),
        )
        self.stop_ids = [set(r.stop_token_ids) for r in requests]
        self.stop_strings = [tuple(r.stop) for r in requests]
        if tokenizer is None and any(self.stop_strings):
            row = next(r for r in requests if r.stop)
            raise ValueError(
                f"{owner}: request {row.tag!r} has stop strings {list(row.stop)} but the engine has no "
                "tokenizer to decode with; pass tokenizer= to the engine"
            )
        self.tokenizer = tokenizer
        self.vocab_start, self.vocab_width = vocab_start, vocab_width
        self.penalised = any(
            r.repetition_penalty != 1 or r.presence_penalty or r.frequency_penalty for r in requests
        )
        if self.penalised:
            self.repetition = torch.tensor([r.repetition_penalty for r in requests], dtype=torch.float32)
            self.presence = torch.tensor([r.presence_penalty for r in requests], dtype=torch.float32)
            self.frequency = torch.tensor([r.frequency_penalty for r in requests], dtype=torch.float32)
            self.prompt_seen = self._counts([r.prompt_ids for r in requests]) > 0  # [B, V_local]
            self.output_counts = torch.zeros_like(self.prompt_seen, dtype=torch.float32)

    def _counts(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        counts = torch.zeros(len(rows), self.vocab_width, dtype=torch.float32)
        for i, ids in enumerate(rows):
            local = torch.as_tensor(list(ids), dtype=torch.int64) - self.vocab_start
            local = local[(local >= 0) & (local < self.vocab_width)]  # other shards' tokens
            counts[i].index_add_(0, local, torch.ones(local.numel()))
        return counts

    def sample(
        self, logits: torch.Tensor, rows: torch.Tensor, step: int, shard: VocabShard = FULL_VOCAB
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and logprobs [A] for `rows` [A] from their logits [A, V_local] at decode `step`."""
        if self.penalised:
            logits = apply_penalties(
                logits.float(),
                self.prompt_seen[rows],
                self.output_counts[rows],
                self.repetition[rows],
                self.presence[rows],
                self.frequency[rows],
            )
        steps = torch.full((rows.numel(),), step, dtype=torch.int64)
        filters = self.filters.select(rows) if self.filters.active else None
        return sample(logits, self.temperatures[rows], self.seeds[rows], steps, filters, shard)

    def record(self, row: int, token: int, sampled: list[int]) -> bool:
        """Book `token` (already appended to the row's `sampled` ids); True if the row stops here."""
        if self.penalised and self.vocab_start <= token < self.vocab_start + self.vocab_width:
            self.output_counts[row, token - self.vocab_start] += 1
        if token in self.stop_ids[row]:
            return True
        stops = self.stop_strings[row]
        if not stops:
            return False
        # vLLM matches stop strings in the detokenised output, special tokens skipped; no match
        # was in the text before this token, so a match now is the first one
        assert self.tokenizer is not None, "__init__ refuses stop strings without a tokenizer"
        text = self.tokenizer.decode(sampled, skip_special_tokens=True)
        return any(s in text for s in stops)


def _column(
    requests: Sequence[GenerationRequest], sampled: list[bool], name: str, off: float, dtype: torch.dtype
) -> torch.Tensor | None:
    """A per-row setting [B], `off` on greedy rows; None when no sampled row uses it."""
    values = [getattr(r, name) if s else off for r, s in zip(requests, sampled, strict=True)]
    if all(v == off for v in values):
        return None
    return torch.tensor(values, dtype=dtype)
