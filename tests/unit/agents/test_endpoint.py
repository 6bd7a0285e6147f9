"""The endpoint with the real `openai` client (sync and async) against the real aiohttp server."""

from __future__ import annotations

import asyncio

import openai
import pytest

from interlens_mcore.agents.server import AgentEndpoint, serve
from interlens_mcore.engines.base import Generation, SamplingParams
from interlens_mcore.engines.hf import HFEngine


class Scripted:
    """A fake engine answering each row with a fixed text (the server is under test, not sampling)."""

    name, max_context = "policy", 4096

    def __init__(self, tokenizer, text: str):
        self.ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.calls: list[list[int]] = []

    def generate(self, requests):
        self.calls.append(list(requests[0].prompt_ids))
        return [
            Generation(token_ids=list(self.ids), logprobs=[-0.5] * len(self.ids), finish_reason="stop")
            for _ in requests
        ]


@pytest.fixture(scope="module")
def engine(tiny):
    model, tokenizer = tiny
    return HFEngine(model, tokenizer), tokenizer


def test_chat_logprobs_and_exact_session(engine):
    eng, tok = engine
    with serve(eng, tok, sampling=SamplingParams(max_new_tokens=8)) as ep:
        client = openai.OpenAI(base_url=ep.url("s1"), api_key="x", max_retries=0)
        history = [{"role": "user", "content": "guess the number between 1 and 7"}]
        for k in range(3):  # the agent re-sends its whole history every call
            r = client.chat.completions.create(
                model="policy", messages=history, logprobs=True, max_tokens=6, seed=k
            )
            choice = r.choices[0]
            assert r.usage.completion_tokens == len(choice.token_ids) <= 6
            assert [c.logprob for c in choice.logprobs.content] and len(choice.logprobs.content) == len(
                choice.token_ids
            )
            session = ep.sessions["s1"]
            node = session.nodes[-1]
            # the prompt the engine saw is the node's ids up to the turn; the reply is verbatim
            assert r.prompt_token_ids == node.ids[: node.turns[-1].start] + ep.chat.generation_prompt_ids()
            start = node.turns[-1].start + len(ep.chat.generation_prompt_ids())
            assert node.ids[start : start + len(choice.token_ids)] == choice.token_ids
            history += [
                {"role": "assistant", "content": choice.message.content},
                {"role": "user", "content": "higher"},
            ]
        assert session.calls == 3 and session.branches == 0
        # every earlier prompt is a prefix of the last: nothing was re-rendered
        last = session.nodes[-1]
        assert all(last.ids[: len(n.ids)] == n.ids for n in session.nodes)
        assert sum(1 for t in last.turns for m in t.mask if m) == sum(
            len(t.logprobs or []) for t in last.turns
        )


def test_rewrite_opens_a_branch_and_stream_parses(engine):
    eng, tok = engine
    with serve(eng, tok, sampling=SamplingParams(max_new_tokens=6)) as ep:
        client = openai.OpenAI(base_url=ep.url(), api_key="x", max_retries=0)
        first = [{"role": "user", "content": "guess the number"}]
        r = client.chat.completions.create(model="policy", messages=first)
        edited = first + [
            {"role": "assistant", "content": r.choices[0].message.content + " edited"},
            {"role": "user", "content": "lower"},
        ]
        chunks = list(
            client.chat.completions.create(
                model="policy", messages=edited, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish and finish[0] in ("stop", "length") and chunks[-1].usage.completion_tokens >= 1
        session = ep.sessions["default"]
        assert session.branches == 1 and "rewrote the history at message 1" in session.departures[0]
        assert isinstance(text, str)


def test_bad_requests_get_openai_errors(engine):
    eng, tok = engine
    with serve(eng, tok) as ep:
        client = openai.OpenAI(base_url=ep.url(), api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="policy", messages=[{"role": "wizard", "content": "hi"}])
        assert err.value.status_code == 400 and "messages[0].role" in err.value.body["message"]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], temperature=-1
            )
        assert err.value.body["param"] == "temperature"
        assert [m.id for m in client.models.list().data] == ["policy"]


def test_tool_calls_and_stop_strings(tiny):
    _, tok = tiny
    eng = Scripted(tok, 'ok <tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with serve(eng, tok) as ep:
        client = openai.OpenAI(base_url=ep.url(), api_key="x", max_retries=0)
        r = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "add"}], tools=tools
        )
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
        assert call.function.arguments == '{"a": 2}' and r.choices[0].message.content == "ok"
        # the tools are presented in the prompt, and the re-sent call extends the session
        assert "add" in tok.decode(eng.calls[0])
        history = [
            {"role": "user", "content": "add"},
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "2"},
        ]
        client.chat.completions.create(model="policy", messages=history, tools=tools)
        assert ep.sessions["default"].branches == 0
        r = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], stop=["<tool_call>"]
        )
        assert r.choices[0].message.content == "ok "


def test_async_client_in_the_loop(engine):
    eng, tok = engine

    async def main():
        ep = AgentEndpoint(eng, tok, sampling=SamplingParams(max_new_tokens=4))
        await ep.start()
        try:
            client = openai.AsyncOpenAI(base_url=ep.url("a"), api_key="x", max_retries=0)
            rs = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": f"hi {i}"}]
                    )
                    for i in range(4)
                )
            )
            await client.close()
            return rs, ep
        finally:
            await ep.stop()

    rs, ep = asyncio.run(main())
    assert len(rs) == 4 and ep.batcher.engine_calls <= 4 and ep.sessions["a"].calls == 4
