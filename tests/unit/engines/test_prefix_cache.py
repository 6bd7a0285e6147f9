"""PrefixCachingEngine: the same tokens as HFEngine over several co_step turns, fewer prefill tokens."""

import pytest

from interlens_mcore import (
    Conversation,
    Environment,
    GenerationRequest,
    HFEngine,
    MaxTurns,
    Message,
    Policy,
    SamplingParams,
    co_step,
)
from interlens_mcore.engines.prefix_cache import PrefixCachingEngine


class Feedback(Environment):
    """A reply whose length differs per conversation, so rows' suffixes differ in width."""

    name = "env"

    def __init__(self, secret: int):
        self.secret = secret

    def respond(self, conv):
        return "higher " * (1 + self.secret % 3) + str(conv.turns_taken)


def _rollout(engine, tok, *, n=5, turns=4, max_new=6):
    # rows alternate greedy and sampled; a stop token is allowed, so some turns end early
    convs = []
    for i in range(n):
        pol = Policy(
            "agent", engine, tok, SamplingParams(temperature=0.0 if i % 2 else 1.0, max_new_tokens=max_new)
        )
        prompt = [Message(speaker="user", content="guess " * (1 + i))]
        convs.append(Conversation([pol, Feedback(i)], prompt, run_until=MaxTurns(2 * turns), id=f"c{i}"))
    co_step(convs, turns=None, max_batch_size=3)  # waves of 3 and 2: rows change neighbours
    return [[(m.token_ids, m.finish_reason) for m in c.messages if m.token_ids] for c in convs]


def test_same_tokens_as_hf_engine_over_turns(tiny):
    model, tok = tiny
    plain = _rollout(HFEngine(model, tok), tok)
    cached_engine = PrefixCachingEngine(model, tok)
    cached = _rollout(cached_engine, tok)
    assert cached == plain
    assert all(len(turns) == 4 for turns in plain)
    # turns 2..4 of every row reuse their history: far fewer prompt tokens are encoded
    assert cached_engine.reuse.reused_tokens > cached_engine.reuse.prefill_tokens


def test_logprobs_match_hf_engine(tiny):
    model, tok = tiny
    req = GenerationRequest(prompt_ids=list(range(5, 30)), max_new_tokens=5, temperature=1.0, seed=3, tag="r")
    longer = GenerationRequest(
        prompt_ids=list(range(5, 30)) + [40, 41, 42], max_new_tokens=5, temperature=1.0, seed=4, tag="r"
    )
    engine = PrefixCachingEngine(model, tok)
    engine.generate([req])
    got = engine.generate([longer])[0]
    want = HFEngine(model, tok).generate([longer])[0]
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert engine.reuse.reused_tokens == 25  # the first call's 25 prompt tokens


def test_edited_history_falls_back_to_common_prefix(tiny):
    model, tok = tiny
    engine = PrefixCachingEngine(model, tok)
    engine.generate(
        [GenerationRequest(prompt_ids=list(range(5, 25)), max_new_tokens=2, temperature=0.0, tag="t")]
    )
    engine.reuse.reset()
    edited = list(range(5, 15)) + [99] * 10  # shares only the first 10 tokens with the entry
    got = engine.generate([GenerationRequest(prompt_ids=edited, max_new_tokens=4, temperature=0.0, tag="t")])
    want = HFEngine(model, tok).generate(
        [GenerationRequest(prompt_ids=edited, max_new_tokens=4, temperature=0.0)]
    )
    assert got[0].token_ids == want[0].token_ids
    assert engine.reuse.reused_tokens == 10 and engine.reuse.prefill_tokens == 10


def test_clear_and_lru_bound(tiny):
    model, tok = tiny
    engine = PrefixCachingEngine(model, tok, max_entries=2)
    for tag in "abc":
        engine.generate([GenerationRequest(prompt_ids=[5, 6, 7], max_new_tokens=2, temperature=0.0, tag=tag)])
    assert list(engine._entries) == ["b", "c"]  # "a" was least recently used
    engine.clear()
    engine.reuse.reset()
    engine.generate([GenerationRequest(prompt_ids=[5, 6, 7, 8], max_new_tokens=1, temperature=0.0, tag="b")])
    assert engine.reuse.reused_tokens == 0


def test_two_seats_of_one_conversation_keep_their_own_entries(tiny):
    """Self-play: seats A and B share the conversation's tag, each prompt from its own side. Each
    seat's second turn continues its own first one, whichever seat spoke last."""
    model, tok = tiny
    engine = PrefixCachingEngine(model, tok)
    opening = list(range(5, 15))
    side_a, side_b = opening + [40] * 8, opening + [60] * 8  # the views part after the opening

    def turn(prompt):
        req = GenerationRequest(prompt_ids=prompt, max_new_tokens=3, temperature=0.0, tag="duel")
        return prompt + engine.generate([req])[0].token_ids

    fed_a = turn(side_a)
    fed_b = turn(side_b)  # B's first turn: only the opening is A's too
    assert engine.reuse.reused_tokens == len(opening)
    engine.reuse.reset()
    # turn 2 of each: its own fed tokens (all but the last sampled id, which was never fed:
    # decoding stops after sampling it), then what the other side said
    next_a, next_b = fed_a + [41, 42], fed_b + [61, 62]
    got_a, got_b = turn(next_a), turn(next_b)
    assert engine.reuse.reused_tokens == (len(fed_a) - 1) + (len(fed_b) - 1)
    # the entry a later turn extends is replaced: one entry a seat
    assert [len(e.ids) for e in engine._entries["duel"]] == [len(got_b) - 1, len(got_a) - 1]
    # the same tokens as prefilling everything
    plain = HFEngine(model, tok)
    for prompt, got in ((next_a, got_a), (next_b, got_b)):
        req = GenerationRequest(prompt_ids=prompt, max_new_tokens=3, temperature=0.0)
        assert prompt + plain.generate([req])[0].token_ids == got


def test_a_tag_keeps_at_most_per_tag_entries_newest_first(tiny):
    model, tok = tiny
    engine = PrefixCachingEngine(model, tok, per_tag=2)
    for first in (50, 60, 70):  # three views that share nothing: none extends another
        req = GenerationRequest(prompt_ids=[first, 6, 7], max_new_tokens=1, temperature=0.0, tag="t")
        engine.generate([req])
    assert [e.ids[0] for e in engine._entries["t"]] == [70, 60]  # the oldest went
    assert engine.lookup("t", [60, 6, 7, 8])[1] == 3 and engine.lookup("t", [50, 6, 7])[1] == 0
    with pytest.raises(ValueError, match="per_tag must be >= 1"):
        PrefixCachingEngine(model, tok, per_tag=0)
