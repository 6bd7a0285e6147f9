"""Filtered sampling over vocabulary shards on 2 gloo ranks equals sampling over the full vocabulary.

Each rank holds half of the same logits, as megatron shards them: the vocabulary of 301 is padded
to 302 and the padded id is -inf on the second shard; the top-k and
top-p thresholds come from per-shard candidates, never from the gathered vocabulary, and must
pick the same tokens bit for bit.
"""

from __future__ import annotations

import torch
from support.dist import run_ranks

B, V, SPLIT = 64, 301, 151  # rank 0 holds ids [0, 151), rank 1 [151, 302), 301 padded


def _case():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(B, V, generator=gen) * 2.5
    logits[::4] = (logits[::4] * 2).round() / 2  # every fourth row full of ties
    temps = torch.rand(B, generator=gen) * 1.5
    temps[::7] = 0.0  # some greedy rows
    top_k = torch.randint(0, 40, (B,), generator=gen)
    top_k[::3] = 0
    top_p = torch.where(torch.rand(B, generator=gen) < 0.7, torch.rand(B, generator=gen) * 0.9 + 0.05, 1.0)
    min_p = torch.where(torch.rand(B, generator=gen) < 0.4, torch.rand(B, generator=gen) * 0.3, 0.0)
    return logits, temps, top_k, top_p.double(), min_p.float()


def _job(rank, world_size):
    from interlens_mcore.engines.sampler import Filters, sample, sample_full_vocab
    from interlens_mcore.megatron.engine import vocab_shard

    logits, temps, top_k, top_p, min_p = _case()
    seeds, steps = torch.arange(B) * 31 + 5, torch.arange(B) % 9
    filters = Filters(top_p=top_p, top_k=top_k, min_p=min_p)
    start, end = rank * SPLIT, min(V, (rank + 1) * SPLIT)
    local = torch.full((B, SPLIT), float("-inf"))
    local[:, : end - start] = logits[:, start:end]
    tokens, logp = sample(
        logits=local, temperatures=temps, seeds=seeds, steps=steps, filters=filters, shard=vocab_shard(start)
    )
    full_tokens, full_logp = sample_full_vocab(logits, temps, seeds, steps, filters)
    # plain lists: tensors through the result queue would need shared-memory handles
    return [x.tolist() for x in (tokens, logp, full_tokens, full_logp)]


def test_sharded_filters_pick_the_full_vocabulary_tokens():
    results = run_ranks(_job, 2, timeout=120)
    (t0, lp0, full_t, full_lp), (t1, lp1, _, _) = [[torch.tensor(x) for x in r] for r in results]
    assert torch.equal(t0, t1) and torch.equal(t0, full_t)
    assert torch.allclose(lp0, full_lp, atol=1e-5) and torch.allclose(lp1, full_lp, atol=1e-5)
    # the case exercises both shards and real filtering (not every row keeps the argmax)
    assert (full_t < SPLIT).any() and (full_t >= SPLIT).any()
    logits, temps, *_ = _case()
    assert (full_t != logits.argmax(-1)).sum() > B // 4
