"""MegatronEngine on real gloo ranks: TP=2 samples exactly what TP=1 samples, rows follow HFEngine.

One 2-rank job runs everything (megatron initialised with TP=1, i.e. each rank alone, then
with TP=2) and returns the generations; the tests assert on them. The tiny Llama has a
vocabulary of 515, so at TP=2 the second shard carries a padded id that must never be sampled.
"""

from __future__ import annotations

import pytest
import torch
from support.dist import run_ranks
from support.play import engine_turns

from interlens_mcore.assets import ensure_tiny_model
from interlens_mcore.engines.base import GenerationRequest

STOPS = tuple(range(0, 512, 4))  # a quarter of the vocabulary: some sampled rows stop early


def _requests() -> list[GenerationRequest]:
    """Rows with their own temperature, seed, cap and stop ids (greedy, cap 0 and cap 1 included)."""
    rows = [
        ([5, 9, 33, 2, 100, 7], 1.0, 11, 24, ()),
        ([1, 2, 3], 0.7, 12, 10, STOPS),
        ([44, 45, 46, 47, 48, 49, 50, 51], 1.3, 13, 12, STOPS),
        ([300, 301], 0.0, 0, 8, ()),
        ([7, 7, 7, 7, 7], 1.0, 11, 0, ()),
        ([12, 13], 1.0, 99, 1, ()),
        ([5, 9, 33, 2, 100, 7], 1.0, 14, 12, STOPS),  # same prompt as row 0, another seed
        ([260, 261], 0.9, 15, 20, ()),
    ]
    return [
        GenerationRequest(
            prompt_ids=p, temperature=t, seed=s, max_new_tokens=n, stop_token_ids=stops, tag=f"row{i}"
        )
        for i, (p, t, s, n, stops) in enumerate(rows)
    ]


def _filtered_requests() -> list[GenerationRequest]:
    """Rows with the sampling options: filters, penalties, stop strings (one option mix per row)."""
    mixes = [
        {"top_k": 7},
        {"top_p": 0.6, "temperature": 1.3},
        {"min_p": 0.3, "top_k": 40},
        {"repetition_penalty": 1.4, "presence_penalty": 0.5, "frequency_penalty": 0.3, "top_p": 0.9},
        {"temperature": 0.0, "repetition_penalty": 2.0},
        {"stop": ("a", "e", "1")},
    ]
    return [
        GenerationRequest(
            prompt_ids=[5 + i, 9, 33, 2, 100 + i], max_new_tokens=12, seed=40 + i, tag=f"f{i}", **m
        )
        for i, m in enumerate(mixes)
    ]


GREEDY_PROMPTS = [[5, 9, 33, 2, 100, 7], [1, 2, 3, 4], [260, 261, 262]]


def _reuse_checks(model, layout, reqs: list[GenerationRequest], group) -> dict:
    """Turns with the prefixes kept and with none kept; then a weight change between two calls."""
    from interlens_mcore.megatron.engine import MegatronEngine

    kept = MegatronEngine(model, layout, group=group)
    none = MegatronEngine(model, layout, group=group, prefix_bytes=0)
    out = {"reuse_turns": engine_turns(kept, reqs), "fresh_turns": engine_turns(none, reqs)}
    out["reused"], out["prefilled"] = kept.reuse.reused_tokens, kept.reuse.prefill_tokens
    out["fresh_reused"], out["fresh_prefilled"] = none.reuse.reused_tokens, none.reuse.prefill_tokens
    out["forwarded"] = (kept.stats.forwards, none.stats.forwards)
    return out


def _load(path):
    from interlens_mcore.megatron import build_model, load_hf_weights, load_layout

    layout = load_layout(path)
    model = build_model(layout, init_weights=False)
    load_hf_weights(model, layout, path)
    return model, layout


def _tp2_checks(rank: int, path: str) -> dict:
    from transformers import AutoTokenizer

    from interlens_mcore import distributed
    from interlens_mcore.megatron.engine import MegatronEngine
    from interlens_mcore.megatron.kv_cache import supports_kv_cache

    reqs = _requests()
    model, layout = _load(path)
    engine = MegatronEngine(model, layout, group=distributed.megatron_tp_group())
    out = {"split": engine.generate(reqs[:4] if rank == 0 else reqs[4:])}  # uneven shares
    out["cached"] = supports_kv_cache(model)  # so "split" above ran with the KV cache
    out.update(_chunked(model, layout, reqs[:4] if rank == 0 else reqs[4:]))
    out["tp2_reuse"] = _reuse_checks(model, layout, reqs[:4] if rank == 0 else reqs[4:], engine.group)
    recompute = MegatronEngine(model, layout, use_kv_cache=False)  # group None: the world
    out["recompute"] = recompute.generate(reqs[:4] if rank == 0 else reqs[4:])
    out["idle"] = engine.generate(reqs[1:3] if rank == 1 else [])  # rank 0 idle, still joins
    greedy = [
        GenerationRequest(prompt_ids=p, max_new_tokens=10, temperature=0.0, stop_token_ids=(2,))
        for p in GREEDY_PROMPTS
    ]
    out["greedy"] = engine.generate(greedy[:2] if rank == 0 else greedy[2:])
    filtered = MegatronEngine(model, layout, tokenizer=AutoTokenizer.from_pretrained(path))
    out["filtered"] = filtered.generate(_filtered_requests()[:2] if rank == 0 else _filtered_requests()[2:])
    out["forward_s"], out["forwards"] = engine.stats.forward_s, engine.stats.forwards
    short = MegatronEngine(model, layout, max_context=16)  # group None: the world (= TP group)
    long_row = GenerationRequest(prompt_ids=list(range(20)), max_new_tokens=4, tag="too-long")
    try:
        short.generate([long_row] if rank == 1 else [])
    except ValueError as exc:  # raised on both ranks, not only on the one that owns the row
        out["context_error"] = str(exc)
    return out


def _chunked(model, layout, reqs: list[GenerationRequest]) -> dict:
    """The same rows with a logits budget of 8 tokens a forward: the prefill in several chunks."""
    import interlens_mcore.megatron.engine as engine_module
    from interlens_mcore import distributed

    def engine():
        return engine_module.MegatronEngine(model, layout, group=distributed.megatron_tp_group())

    plain = engine()
    out = {"plain": plain.generate(reqs), "plain_forwards": plain.stats.forwards}
    budget = engine_module.LOGITS_BUDGET
    engine_module.LOGITS_BUDGET = layout.vocab_per_rank * 8  # every rank of the TP group alike
    try:
        chunked = engine()
        out["chunked"] = chunked.generate(reqs)
        out["chunked_forwards"] = chunked.stats.forwards
    finally:
        engine_module.LOGITS_BUDGET = budget
    return out


def _engine_job(rank, world_size, path: str):
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import distributed
    from interlens_mcore.engines.hf import HFEngine
    from interlens_mcore.megatron.engine import MegatronEngine

    out: dict = {}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        model, layout = _load(path)
        tp_group = distributed.megatron_tp_group()
        out["tp1"] = MegatronEngine(model, layout, group=tp_group).generate(_requests())
        tok = AutoTokenizer.from_pretrained(path)
        tp1 = MegatronEngine(model, layout, group=distributed.megatron_tp_group(), tokenizer=tok)
        out["tp1_filtered"] = tp1.generate(_filtered_requests())
        out["tp1_reuse"] = _reuse_checks(model, layout, _requests(), tp_group)
        out.update(_weights_change(model, layout, tp_group))
        try:
            MegatronEngine(model, layout, group=tp_group).generate(_filtered_requests())
        except ValueError as exc:
            out["no_tokenizer_error"] = str(exc)
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        out.update(_tp2_checks(rank, path))
    finally:
        parallel_state.destroy_model_parallel()
    if rank == 0:
        hf = AutoModelForCausalLM.from_pretrained(path).eval()
        out["hf_engine"] = HFEngine(hf, AutoTokenizer.from_pretrained(path)).generate(_requests())
        out["hf_filtered"] = HFEngine(hf, AutoTokenizer.from_pretrained(path)).generate(_filtered_requests())
        with torch.no_grad():
            out["hf_greedy"] = [
                hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=2)[
                    0, len(p) :
                ].tolist()
                for p in GREEDY_PROMPTS
            ]
    return out


def _weights_change(model, layout, group) -> dict:
    """A row's second call after an in-place weight update equals a fresh engine's on the new
    weights: the kept keys/values of the old weights are dropped, not reused."""
    from interlens_mcore.megatron.engine import MegatronEngine

    reqs = _requests()
    engine = MegatronEngine(model, layout, group=group)
    first = engine.generate(reqs)
    again = [
        GenerationRequest(
            prompt_ids=[*r.prompt_ids, *g.token_ids, 3], seed=r.seed, max_new_tokens=6, tag=r.tag
        )
        for r, g in zip(reqs, first, strict=True)
    ]
    weight = next(p for p in model.parameters() if p.dim() == 2)
    with torch.no_grad():
        weight.add_(0.05)  # what an optimizer step does to a parameter: in place
    try:
        moved = engine.generate(again)
        reused_after_change = engine.reuse.reused_tokens
        fresh = MegatronEngine(model, layout, group=group, prefix_bytes=0).generate(again)
    finally:
        with torch.no_grad():
            weight.sub_(0.05)
    return {"moved": moved, "moved_fresh": fresh, "reused_after_change": reused_after_change}


@pytest.fixture(scope="module")
def ranks():
    # the same cached model as test_megatron_convert: untied, init 0.1 so logits are O(1)
    path = ensure_tiny_model(arch="llama", vocab_size=515, tie_word_embeddings=False, initializer_range=0.1)
    return run_ranks(_engine_job, 2, str(path), timeout=180)


def _tokens(gens):
    return [(g.token_ids, g.finish_reason) for g in gens]


def test_tp2_sampling_equals_tp1_token_for_token(ranks):
    r0, r1 = ranks
    assert _tokens(r0["tp1"]) == _tokens(r1["tp1"])  # each rank alone at TP=1
    tp2 = r0["split"] + r1["split"]  # rank 0 owned rows 0-3, rank 1 rows 4-7
    assert _tokens(tp2) == _tokens(r0["tp1"])
    for a, b in zip(tp2, r0["tp1"], strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert sum(len(g.token_ids) for g in tp2) > 60  # the comparison covers many sampled tokens


def test_sampling_options_tp2_equals_tp1_and_hf_engine(ranks):
    r0, r1 = ranks
    tp2 = r0["filtered"] + r1["filtered"]
    assert _tokens(tp2) == _tokens(r0["tp1_filtered"]) == _tokens(r1["tp1_filtered"])
    assert _tokens(r0["hf_filtered"]) == _tokens(tp2)
    for a, b in zip(tp2, r0["hf_filtered"], strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    stopped = tp2[-1]  # stop strings: the first match ends the turn, the ids stay verbatim
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 12
    assert "'f5'" in r0["no_tokenizer_error"] and "tokenizer=" in r0["no_tokenizer_error"]


def test_kv_cache_equals_full_recompute(ranks):
    for r in ranks:
        assert r["cached"]
        assert _tokens(r["recompute"]) == _tokens(r["split"])
        for a, b in zip(r["recompute"], r["split"], strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def _same(a, b):
    assert _tokens(a) == _tokens(b)
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_kept_prefixes_sample_what_a_full_prefill_samples_over_turns(ranks):
    for r in ranks:
        got = r["tp1_reuse"]
        for kept, fresh in zip(got["reuse_turns"], got["fresh_turns"], strict=True):
            _same(kept, fresh)
        # turns 2 and 3 encode only what was appended: most prompt tokens came from the store
        assert got["reused"] > got["prefilled"] / 2 and got["fresh_reused"] == 0
        assert got["reused"] + got["prefilled"] == got["fresh_prefilled"]
        assert sum(len(g.token_ids) for turn in got["reuse_turns"] for g in turn) > 100


def test_kept_prefixes_under_tp2_equal_tp1(ranks):
    r0, r1 = ranks
    tp2 = [a + b for a, b in zip(r0["tp2_reuse"]["reuse_turns"], r1["tp2_reuse"]["reuse_turns"], strict=True)]
    for turn, want in zip(tp2, r0["tp1_reuse"]["reuse_turns"], strict=True):
        _same(turn, want)
    # both TP ranks fed the same tokens (a rank feeding fewer would hang the forward's all-reduce)
    assert r0["tp2_reuse"]["reused"] == r1["tp2_reuse"]["reused"] > 0
    assert r0["tp2_reuse"]["forwarded"] == r1["tp2_reuse"]["forwarded"]


def test_a_weight_update_drops_the_kept_prefixes(ranks):
    for r in ranks:
        assert r["reused_after_change"] == 0
        _same(r["moved"], r["moved_fresh"])


def test_a_prefill_in_chunks_samples_what_one_forward_samples(ranks):
    for r in ranks:
        assert _tokens(r["chunked"]) == _tokens(r["plain"])
        for a, b in zip(r["chunked"], r["plain"], strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert r["chunked_forwards"] > r["plain_forwards"]  # the prefill took several forwards


def test_idle_rank_joins_and_each_rank_keeps_its_rows(ranks):
    r0, r1 = ranks
    assert r0["idle"] == []
    assert _tokens(r1["idle"]) == _tokens(r0["tp1"][1:3])  # rows do not depend on their batch
    assert r0["forwards"] == r1["forwards"] > 0 and r0["forward_s"] > 0


def test_rows_follow_hf_engine(ranks):
    reqs, mega, hf = _requests(), ranks[0]["tp1"], ranks[0]["hf_engine"]
    assert _tokens(mega) == _tokens(hf)
    for a, b in zip(mega, hf, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert mega[4].token_ids == [] and len(mega[5].token_ids) == 1  # caps 0 and 1
    assert any(g.finish_reason == "stop" for g in mega)  # the stop path is exercised
    for r, g in zip(reqs, mega, strict=True):
        if g.finish_reason == "stop":
            assert g.token_ids[-1] in r.stop_token_ids and len(g.token_ids) <= r.max_new_tokens
        else:
            assert len(g.token_ids) == r.max_new_tokens
            assert not set(g.token_ids) & set(r.stop_token_ids)


def test_greedy_equals_transformers_generate(ranks):
    r0, r1 = ranks
    got = [g.token_ids for g in r0["greedy"] + r1["greedy"]]
    assert got == r0["hf_greedy"]
    assert all(len(t) > 0 for t in got)


def test_context_error_names_the_row_on_every_rank(ranks):
    for r in ranks:
        assert "'too-long'" in r["context_error"] and "16 tokens" in r["context_error"]


def test_sample_vocab_parallel_matches_full_vocab_on_one_rank():
    from interlens_mcore.engines.sampler import sample_full_vocab
    from interlens_mcore.megatron.engine import sample_vocab_parallel

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3  # [B, V]
    temps = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 0.0])
    seeds, steps = torch.arange(6), torch.tensor([0, 1, 2, 3, 4, 5])
    tokens, logp = sample_vocab_parallel(logits, temps, seeds, steps, start=0, group=None)
    want_tokens, want_logp = sample_full_vocab(logits, temps, seeds, steps)
    assert torch.equal(tokens, want_tokens)
    assert torch.allclose(logp, want_logp, atol=1e-5)
    assert tokens[0] == logits[0].argmax() and tokens[5] == logits[5].argmax()  # greedy rows
