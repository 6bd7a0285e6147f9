"""VLLMEngine: rows rescored by the HF model agree with vLLM's logprobs, seeds, stops, weight updates.

Runs where vLLM is installed (the second environment that .ci/vllm_stage.sh builds: the CPU
build of vLLM pins transformers<5.20, this project needs >=5.24).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "vllm", reason="vLLM is not installed here; its tests run in the environment .ci/vllm_stage.sh builds"
)

from interlens_mcore import GenerationRequest, HFEngine, SamplingParams  # noqa: E402
from interlens_mcore.engines.sampler import Filters, apply_penalties, processed_logprobs  # noqa: E402
from interlens_mcore.engines.vllm import VLLMConfig, VLLMEngine  # noqa: E402
from interlens_mcore.engines.weight_sync import hf_tensors  # noqa: E402


@pytest.fixture(scope="module")
def engine(tiny_path):
    config = VLLMConfig(colocated=False, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    return VLLMEngine.create(str(tiny_path), config)


def _rescore(model, req: GenerationRequest, token_ids: list[int]) -> torch.Tensor:
    """Logprob of each sampled id under `req`'s processed distribution, from the HF model [G]."""
    n, g = len(req.prompt_ids), len(token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([list(req.prompt_ids) + token_ids])).logits[0, n - 1 : n - 1 + g].float()
    vocab = logits.shape[-1]
    tokens = torch.tensor(token_ids)
    seen = torch.zeros(g, vocab, dtype=torch.bool)
    seen[:, list(req.prompt_ids)] = True
    counts = torch.zeros(g, vocab)
    for t in range(1, g):  # the counts at step t are those of the ids sampled before it
        counts[t] = counts[t - 1]
        counts[t, token_ids[t - 1]] += 1
    full = lambda x, dtype=torch.float32: torch.full((g,), x, dtype=dtype)
    logits = apply_penalties(
        logits,
        seen,
        counts,
        full(req.repetition_penalty),
        full(req.presence_penalty),
        full(req.frequency_penalty),
    )
    filters = None
    if req.temperature > 0:
        filters = Filters(
            top_p=full(req.top_p, torch.float64), top_k=full(req.top_k, torch.int64), min_p=full(req.min_p)
        )
    return processed_logprobs(logits, tokens, full(req.temperature), filters)


MIXES = [
    {},
    {"temperature": 0.7},
    {"top_k": 20, "temperature": 1.2},
    {"top_p": 0.8},
    {"min_p": 0.1, "repetition_penalty": 1.3},
    {"presence_penalty": 0.8, "frequency_penalty": 0.4},
    {"temperature": 0.0},
]


def _rows(n_tokens=16):
    return [
        GenerationRequest(
            prompt_ids=list(range(7 + i, 19 + 2 * i)), max_new_tokens=n_tokens, seed=100 + i, tag=f"v{i}", **m
        )
        for i, m in enumerate(MIXES)
    ]


def test_rescoring_with_the_hf_model_agrees(engine, tiny):
    model, _ = tiny
    rows = _rows()
    gens = engine.generate(rows)
    assert all(len(g.token_ids) == 16 and g.finish_reason == "length" for g in gens)
    for r, g in zip(rows, gens, strict=True):
        want = _rescore(model, r, g.token_ids)
        assert torch.isfinite(want).all(), f"{r.tag}: vLLM sampled a token our filters remove"
        assert g.logprobs == pytest.approx(want.tolist(), abs=2e-3), r.tag
    # greedy equals the HF model's argmax chain
    greedy = HFEngine(model, tiny[1]).generate([rows[-1]])[0]
    assert gens[-1].token_ids == greedy.token_ids


def test_seeds_make_rows_independent_of_their_batch(engine):
    rows = _rows(8)
    together = engine.generate(rows)
    alone = [engine.generate([r])[0] for r in rows[:3]]
    assert [g.token_ids for g in alone] == [g.token_ids for g in together[:3]]
    reseeded = engine.generate([GenerationRequest(prompt_ids=rows[0].prompt_ids, max_new_tokens=8, seed=7)])
    assert reseeded[0].token_ids != together[0].token_ids  # another seed, other tokens


def test_stop_ids_and_strings_end_the_turn(engine, tiny):
    _, tok = tiny
    prompt = tok("the quick brown fox")["input_ids"]

    def run(**options):
        return engine.generate([GenerationRequest(prompt_ids=prompt, max_new_tokens=24, seed=3, **options)])[
            0
        ]

    free = run()
    assert len(free.token_ids) == 24
    piece = [tok.decode(free.token_ids[k : k + 1]).strip() for k in range(24)]
    cut = next(
        k
        for k in range(2, 24)
        if piece[k].isalnum() and piece[k] not in tok.decode(free.token_ids[:k], skip_special_tokens=True)
    )
    by_string = run(stop=(piece[cut],))
    assert by_string.finish_reason == "stop"
    assert by_string.token_ids == free.token_ids[: cut + 1]  # up to and including the match, verbatim
    assert by_string.logprobs == pytest.approx(free.logprobs[: cut + 1], abs=1e-5)
    req = SamplingParams(max_new_tokens=24, stop_token_ids=[free.token_ids[cut]]).request(prompt, seed=3)
    by_id = engine.generate([req])[0]
    first = free.token_ids.index(free.token_ids[cut])
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: first + 1]


def test_zero_caps_and_context_errors(engine):
    rows = [
        GenerationRequest(prompt_ids=[5, 6], max_new_tokens=0),
        GenerationRequest(prompt_ids=[5, 6], max_new_tokens=3),
    ]
    gens = engine.generate(rows)
    assert gens[0].token_ids == [] and len(gens[1].token_ids) == 3
    with pytest.raises(ValueError, match="'long'.*256 tokens"):
        engine.generate([GenerationRequest(prompt_ids=list(range(300)), max_new_tokens=3, tag="long")])


def test_weight_update_follows_the_hf_model(engine, tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    assert engine.tied and model.config.tie_word_embeddings  # lm_head comes from the embedding
    prompts = [list(range(5, 15)), list(range(40, 47)), [300, 301, 302]]
    greedy = [GenerationRequest(prompt_ids=p, max_new_tokens=12, temperature=0.0) for p in prompts]
    before = [g.token_ids for g in engine.generate(greedy)]
    assert before == [g.token_ids for g in HFEngine(model, tok).generate(greedy)]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a "training step": every weight moves, the tied embedding included
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    report = engine.update_weights(hf_tensors(model))
    after = [g.token_ids for g in engine.generate(greedy)]
    assert after == [g.token_ids for g in HFEngine(model, tok).generate(greedy)]
    assert after != before
    n_params = len(list(model.parameters()))
    assert report.tensors == n_params + 1 and report.seconds > 0 and report.bytes > 0  # + lm_head.weight
    original = AutoModelForCausalLM.from_pretrained(tiny_path)
    engine.update_weights(hf_tensors(original))  # and back: the first generations return exactly
    assert [g.token_ids for g in engine.generate(greedy)] == before
