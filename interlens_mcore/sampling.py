"""Counter-based sampling: the noise for (seed, step, token) is a pure function of those three.

A row's tokens therefore never depend on its batch, its wave, its neighbours or how the
vocabulary is sharded: a tensor-parallel rank computes the noise of its own vocabulary slice
and the Gumbel-max argmax over the shards equals the one over the full vocabulary.
"""

from __future__ import annotations

import functools

import torch

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
    t = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    scores = logits.float() / t[:, None]
    noise = gumbel_noise(seeds, steps, vocab_start, vocab_start + logits.shape[-1])
    return torch.where(greedy[:, None], scores, scores + noise)


def sample_full_vocab(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from full-vocabulary logits [B, V].

    Returns (token ids [B], logprob of each under the temperature-scaled distribution [B];
    greedy rows report the logprob under temperature 1).
    """
    tokens = perturbed_scores(logits, temperatures, seeds, steps).argmax(dim=-1)  # [B]
    t = torch.where(temperatures <= 0, torch.ones_like(temperatures), temperatures)
    logp = torch.log_softmax(logits.float() / t[:, None], dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
