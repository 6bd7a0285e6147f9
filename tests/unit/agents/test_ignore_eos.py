"""`ignore_eos` (vLLM's request field): replies run to `max_tokens` past the end of turn."""

from __future__ import annotations

import openai
import pytest

from interlens_mcore.agents.server import serve
from interlens_mcore.engines.base import Generation, SamplingParams
from interlens_mcore.engines.hf import HFEngine


class Recording:
    """The real engine, with every request it was given kept."""

    def __init__(self, engine):
        self.engine, self.name, self.max_context = engine, engine.name, engine.max_context
        self.requests = []

    def generate(self, requests):
        self.requests.extend(requests)
        return self.engine.generate(requests)


class EndsWith:
    """A fake engine whose every reply is `ids`, cut at the cap (finish "length")."""

    name, max_context = "policy", 4096

    def __init__(self, ids):
        self.ids = list(ids)

    def generate(self, requests):
        return [
            Generation(token_ids=self.ids, logprobs=[-1.0] * len(self.ids), finish_reason="length")
            for _ in requests
        ]


@pytest.fixture(scope="module")
def recording(tiny):
    model, tok = tiny
    return Recording(HFEngine(model, tok)), tok


def test_ignore_eos_samples_to_max_tokens(recording):
    eng, tok = recording
    eos = tok.eos_token_id
    with serve(eng, tok, sampling=SamplingParams(max_new_tokens=12, stop_token_ids=(7,))) as ep:
        client = openai.OpenAI(base_url=ep.url("s"), api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "count"}]
        for seed in range(4):
            r = client.chat.completions.create(
                model="policy", messages=messages, max_tokens=9, seed=seed, extra_body={"ignore_eos": True}
            )
            if 7 not in r.choices[0].token_ids:  # the trainer's stop id still stops it
                assert len(r.choices[0].token_ids) == 9 and r.choices[0].finish_reason == "length"
        client.chat.completions.create(model="policy", messages=messages, max_tokens=9)
    stops = [r.stop_token_ids for r in eng.requests]
    assert stops == [(7,)] * 4 + [(eos, 7)]  # eos dropped only where the request said so


def test_ignore_eos_keeps_the_length_close(tiny):
    # a reply cut at its cap whose last sampled id is eos: without ignore_eos that eos closed
    # the turn; with it the eos is one more sampled token and the template's whole tail follows
    _, tok = tiny
    sampled = tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id]
    with serve(EndsWith(sampled), tok) as ep:
        client = openai.OpenAI(base_url=ep.url(), api_key="x", max_retries=0)
        for sid, extra in (("plain", {}), ("ignore", {"ignore_eos": True})):
            client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "hi"}],
                extra_body=extra,
                extra_headers={"X-Session-Id": sid},
            )
    for sid, close in (("plain", ep.chat.close_ids("stop")), ("ignore", ep.chat.close_ids("length"))):
        node = ep.sessions[sid].nodes[-1]
        assert node.ids[-len(sampled) - len(close) :] == sampled + close
    assert ep.chat.close_ids("stop") != ep.chat.close_ids("length")


def test_ignore_eos_must_be_a_boolean(recording):
    eng, tok = recording
    with serve(eng, tok) as ep:
        client = openai.OpenAI(base_url=ep.url(), api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": "yes"}
            )
    assert err.value.body["param"] == "ignore_eos" and "true or false" in err.value.body["message"]
