"""Sampling options against hand-worked distributions; engines keep rows batch-invariant with them."""

from __future__ import annotations

import math

import pytest
import torch

from interlens_mcore import GenerationRequest, HFEngine, SamplingParams
from interlens_mcore.engines.prefix_cache import PrefixCachingEngine
from interlens_mcore.engines.sampler import Filters, apply_penalties, sample_full_vocab

PROBS = [0.5, 0.3, 0.2]  # one row, three tokens


def _draw(probs, n=4000, temperature=1.0, **filters):
    """Tokens and logprobs of `n` seeds on one row of logits log(probs)."""
    logits = torch.tensor(probs).log().repeat(n, 1)  # [n, V]
    f = {k: torch.full((n,), v, dtype=torch.float64 if k == "top_p" else None) for k, v in filters.items()}
    if "top_k" in f:
        f["top_k"] = f["top_k"].long()
    temps = torch.full((n,), float(temperature))
    tokens, logp = sample_full_vocab(
        logits, temps, torch.arange(n), torch.zeros(n, dtype=torch.long), Filters(**f)
    )
    return tokens, logp


def _frequencies(tokens, vocab):
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


@pytest.mark.parametrize(
    "filters, kept",
    [
        # top-k 2: tokens 0, 1 renormalised to 0.5/0.8 = 0.625 and 0.3/0.8 = 0.375
        ({"top_k": 2}, [0.625, 0.375, 0.0]),
        # top-p 0.7: token 1 has 0.5 < 0.7 above it (kept), token 2 has 0.8 (dropped)
        ({"top_p": 0.7}, [0.625, 0.375, 0.0]),
        # top-p 0.5: token 1 already has 0.5 above it, not < 0.5: only token 0 is left
        ({"top_p": 0.5}, [1.0, 0.0, 0.0]),
        # min-p 0.5: keep p >= 0.5 * 0.5 = 0.25: tokens 0 and 1
        ({"min_p": 0.5}, [0.625, 0.375, 0.0]),
        # min-p 0.3 keeps everything (0.2 >= 0.15); top-k 1 leaves the argmax
        ({"min_p": 0.3, "top_k": 1}, [1.0, 0.0, 0.0]),
        ({"top_p": 1.0, "top_k": 0, "min_p": 0.0}, PROBS),  # all off
    ],
)
def test_filters_sample_the_renormalised_survivors(filters, kept):
    tokens, logp = _draw(PROBS, **filters)
    freq = _frequencies(tokens, 3)
    # 4000 draws: the standard error of a frequency is at most 0.008
    assert freq.tolist() == pytest.approx(kept, abs=0.03)
    want = torch.tensor([math.log(p) if p else float("nan") for p in kept])
    assert torch.allclose(logp, want[tokens], atol=1e-5)  # logprob under the distribution sampled from


def test_top_p_keeps_ties_at_the_boundary():
    # probs 0.4, 0.3, 0.3 and top-p 0.6: both 0.3 tokens have only 0.4 strictly above them
    tokens, logp = _draw([0.4, 0.3, 0.3], top_p=0.6)
    assert set(tokens.tolist()) == {0, 1, 2}
    # the 0.3 tokens with 0.4 above: all three kept, so nothing is renormalised
    assert torch.allclose(logp, torch.tensor([0.4, 0.3, 0.3]).log()[tokens], atol=1e-5)


def test_temperature_then_top_k_hand_worked():
    # logits [2, 1, 0, -1] at T = 2 are [1, 0.5, 0, -0.5]; top-k 3 drops the last
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    n = logits.shape[0]
    f = Filters(top_k=torch.full((n,), 3))
    tokens, logp = sample_full_vocab(logits, torch.full((n,), 2.0), torch.arange(n), torch.zeros(n).long(), f)
    z = math.exp(1) + math.exp(0.5) + 1.0
    want = torch.tensor([1 - math.log(z), 0.5 - math.log(z), -math.log(z), float("nan")])
    assert 3 not in tokens.tolist()
    assert torch.allclose(logp, want[tokens], atol=1e-5)
    assert _frequencies(tokens, 4)[0] == pytest.approx(math.exp(1) / z, abs=0.035)


def test_greedy_rows_ignore_filters_and_report_temperature_one():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    f = Filters(top_k=torch.tensor([1, 1]), min_p=torch.tensor([0.9, 0.9]))
    tokens, logp = sample_full_vocab(
        logits, torch.tensor([0.0, 0.0]), torch.arange(2), torch.zeros(2).long(), f
    )
    assert tokens.tolist() == [1, 1]
    assert logp.tolist() == pytest.approx([torch.log_softmax(logits[0], -1)[1].item()] * 2, abs=1e-6)


def test_penalties_hand_worked():
    # prompt holds token 0; the output so far: token 1 twice, token 3 once
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    prompt_seen = torch.tensor([[True, False, False, False]])
    counts = torch.tensor([[0.0, 2.0, 0.0, 1.0]])
    out = apply_penalties(
        logits, prompt_seen, counts, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25])
    )
    # token 0: 2 / 2 (seen in the prompt, positive); token 1: -1 * 2 - 0.25 * 2 - 0.5 = -3
    # token 2: never seen, unchanged; token 3: 3 / 2 - 0.25 - 0.5 = 0.75
    assert out.tolist() == [[1.0, -3.0, 0.5, 0.75]]


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.2),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("max_new_tokens", 0),
    ],
)
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must"):
        SamplingParams(**{field: value})
    if field != "max_new_tokens":
        with pytest.raises(ValueError, match=f"GenerationRequest 'row'.{field} must"):
            GenerationRequest(prompt_ids=[1], max_new_tokens=1, tag="row", **{field: value})


def test_request_merges_stop_ids_and_normalises():
    params = SamplingParams(stop="</a>", top_k=-1, stop_token_ids=[9, 3], temperature=0.5, top_p=0.9)
    req = params.request([1, 2], seed=4, stop_token_ids=(3, 2), tag="c0")
    assert req.stop == ("</a>",) and req.top_k == 0  # a string is one stop; -1 means off
    assert req.stop_token_ids == (3, 2, 9)  # the chat's, then the policy's own, once each
    assert (req.temperature, req.top_p, req.max_new_tokens, req.seed) == (0.5, 0.9, 64, 4)


OPTIONS = [
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 0.8, "top_p": 0.8},
    {"temperature": 1.2, "min_p": 0.2, "repetition_penalty": 1.3},
    {"temperature": 1.0, "presence_penalty": 1.0, "frequency_penalty": 0.5, "top_p": 0.95, "top_k": 50},
    {"temperature": 0.0, "repetition_penalty": 1.5},
]


def _rows(prompts, max_new=8):
    return [
        GenerationRequest(prompt_ids=p, max_new_tokens=max_new, seed=20 + i, tag=f"r{i}", **OPTIONS[i % 5])
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("engine_type", [HFEngine, PrefixCachingEngine])
def test_filtered_rows_do_not_depend_on_their_batch(tiny, engine_type):
    model, tok = tiny
    prompts = [list(range(5, 12 + 3 * i)) for i in range(5)]
    rows = _rows(prompts)
    together = engine_type(model, tok).generate(rows)
    alone = [engine_type(model, tok).generate([r])[0] for r in rows]
    reversed_ = engine_type(model, tok).generate(rows[::-1])[::-1]
    for a, b, c in zip(together, alone, reversed_, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert all(len(g.token_ids) == 8 for g in together)
    # the filters change what is sampled: the same seeds with no options give other tokens
    plain = HFEngine(model, tok).generate(
        [GenerationRequest(prompt_ids=r.prompt_ids, max_new_tokens=8, seed=r.seed) for r in rows]
    )
    assert [g.token_ids for g in plain] != [g.token_ids for g in together]


def test_top_k_one_is_greedy_and_repetition_penalty_avoids_repeats(tiny):
    model, tok = tiny
    prompt = list(range(5, 15))
    greedy = HFEngine(model, tok).generate(
        [GenerationRequest(prompt_ids=prompt, max_new_tokens=12, temperature=0)]
    )
    top1 = HFEngine(model, tok).generate(
        [GenerationRequest(prompt_ids=prompt, max_new_tokens=12, temperature=1.0, top_k=1, seed=5)]
    )
    assert top1[0].token_ids == greedy[0].token_ids
    assert top1[0].logprobs == pytest.approx([0.0] * 12, abs=1e-6)  # one survivor: probability 1
    # a huge repetition penalty on a greedy row: no token of the prompt or output comes twice
    strict = HFEngine(model, tok).generate(
        [GenerationRequest(prompt_ids=prompt, max_new_tokens=12, temperature=0, repetition_penalty=1e6)]
    )
    ids = strict[0].token_ids
    assert len(set(ids)) == len(ids) and not set(ids) & set(prompt)


def test_stop_strings_end_the_turn_at_the_first_match(tiny):
    model, tok = tiny
    prompt = tok("the quick brown fox")["input_ids"]

    def run(**options):
        req = GenerationRequest(prompt_ids=prompt, max_new_tokens=24, temperature=1.0, seed=3, **options)
        return HFEngine(model, tok).generate([req])[0]

    free = run()
    piece = [tok.decode(free.token_ids[k : k + 1]).strip() for k in range(len(free.token_ids))]
    # a stop string that first appears mid-turn: a word-like token not in the text before it
    cut = next(
        k
        for k in range(2, len(piece))
        if piece[k].isalnum() and piece[k] not in tok.decode(free.token_ids[:k], skip_special_tokens=True)
    )
    got = run(stop=(piece[cut], "never-seen-xyz"))
    assert got.finish_reason == "stop"
    assert got.token_ids == free.token_ids[: cut + 1]  # the sampled ids up to the match, verbatim
    assert got.logprobs == pytest.approx(free.logprobs[: cut + 1], abs=1e-6)
    # a policy's own stop id joins the chat's: the turn ends at its first occurrence
    stop_id = free.token_ids[cut]
    req = SamplingParams(max_new_tokens=24, stop_token_ids=[stop_id]).request(prompt, seed=3)
    by_id = HFEngine(model, tok).generate([req])[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: cut + 1]
    assert run(stop=("never-seen-xyz",)).token_ids == free.token_ids  # no match: the whole turn
