"""Tools: schemas, the call parser on malformed input, ToolEnvironment, with_tools end to end."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.fakes import ScriptEngine
from support.play import play

from interlens_mcore.rollout.conversation import Conversation, Scripted
from interlens_mcore.rollout.costep import co_step
from interlens_mcore.rollout.stop import MaxTurns
from interlens_mcore.tasks import dataset as ds_tasks
from interlens_mcore.tasks import textarena as ta_tasks
from interlens_mcore.tools import (
    HermesParser,
    ToolEnvironment,
    as_tool,
    load_tools,
    template_preamble,
    tool_metrics,
    tools_system_text,
    with_tools,
)
from interlens_mcore.tools.examples import calculator, python_eval
from interlens_mcore.types import Status


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


async def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "awake"


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("kaput")


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_schemas_and_loading():
    assert as_tool(add).schema["function"]["parameters"]["required"] == ["a", "b"]
    tools = load_tools("interlens_mcore.tools.examples:calculator,interlens_mcore.tools.examples:python_eval")
    assert [t.name for t in tools] == ["calculator", "python_eval"]
    with pytest.raises(ValueError, match="expected MODULE:FN"):
        load_tools("calculator")
    with pytest.raises(ValueError, match="cannot import"):
        load_tools("interlens_mcore.tools.examples:nope")
    with pytest.raises(ValueError, match="distinct"):
        load_tools(["interlens_mcore.tools.examples:calculator"] * 2)

    def untyped(x):
        """No hints."""

    with pytest.raises(ValueError, match="'untyped': no JSON schema"):
        as_tool(untyped)


PARSER = HermesParser()


@pytest.mark.parametrize(
    "text,calls,errors",
    [
        ("no calls here", 0, 0),
        (call("add", a=1, b=2), 1, 0),
        (call("add", a=1, b=2) + " and " + call("calculator", expression="1"), 2, 0),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}', 1, 0),  # stop string dropped
        ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', 1, 0),  # string arguments
        ('<tool_call>{"name": "add"}</tool_call>', 1, 0),
        ("<tool_call></tool_call>", 0, 1),
        ("<tool_call>not json</tool_call>", 0, 1),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', 0, 1),  # truncated
        ("<tool_call>[1, 2]</tool_call>", 0, 1),
        ('<tool_call>{"arguments": {}}</tool_call>', 0, 1),
        ('<tool_call>{"name": ""}</tool_call>', 0, 1),
        ('<tool_call>{"name": 3}</tool_call>', 0, 1),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', 0, 1),
        ('<tool_call>{"name": "add", "arguments": "nope"}</tool_call>', 0, 1),
        ('<tool_call>{"name": "add", "args": {}}</tool_call>', 0, 1),
        ("stray </tool_call> close", 0, 1),
        ('<tool_call><tool_call>{"name": "add"}</tool_call>', 1, 1),  # nested opening
        ("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", 0, 1),
        (call("add") * 9, 8, 1),  # the per-reply limit
    ],
)
def test_parser_malformed_inputs(text, calls, errors):
    parsed = PARSER.parse(text)
    assert (len(parsed.calls), len(parsed.errors)) == (calls, errors), parsed
    assert all(isinstance(e, str) and e for e in parsed.errors)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(list('<>/tool_cal{}[]":, nme\\ar1') + ["<tool_call>", "</tool_call>"])).map(
        "".join
    )
)
def test_parser_never_raises(text):
    parsed = PARSER.parse(text)
    # every opening tag ends as a call or an error; only tags can make either
    opened, closed = text.count("<tool_call>"), text.count("</tool_call>")
    assert opened <= parsed.attempted <= opened + closed
    for c in parsed.calls:
        assert isinstance(c.name, str) and isinstance(c.arguments, dict)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=5), st.integers() | st.text(max_size=5), max_size=3))
def test_parser_roundtrips_well_formed_calls(arguments):
    body = json.dumps({"name": "f", "arguments": arguments})
    parsed = PARSER.parse(f"prefix <tool_call>{body}</tool_call> suffix")
    assert parsed.errors == () and parsed.calls[0].arguments == arguments


def _run(replies, tools, **kw):
    policy = Scripted("policy", replies, role="assistant")
    judge = Scripted("judge", ["judged"])
    env = ToolEnvironment(tools, judge, **kw)
    conv = Conversation([policy, env], run_until=MaxTurns(2 * len(replies)))
    co_step([conv], step_timeout_s=60.0)  # against a hang; a first call may wait for a worker to start
    return conv


def test_tool_environment_results_errors_and_counts():
    replies = [
        call("add", a=2, b=3),
        call("nope") + call("add", a=1),  # unknown tool, missing argument
        call("boom", x=1) + "<tool_call>{bad</tool_call>",
        "final answer",
    ]
    conv = _run(replies, [add, boom], max_calls=5)
    said = [(m.speaker, m.role, m.content) for m in conv.messages]
    assert said[1] == ("judge", "tool", "5")
    assert "unknown tool 'nope'" in said[3][2] and "needs the argument 'b'" in said[3][2]
    assert "raised RuntimeError: kaput" in said[5][2] and "not valid JSON" in said[5][2]
    assert said[7] == ("judge", "user", "judged")  # the plain reply reaches the wrapped environment
    # 5 calls attempted: add (ok), nope, add without b, boom (a valid call that raised), bad JSON
    assert conv.infos["tool_calls"] == 5 and conv.infos["tool_turns"] == 3
    assert conv.infos["tool_valid_calls"] == 2 and conv.infos["tool_errors"] == 4


def test_answer_rates_valid_call_and_result_used():
    # a call, then an answer that holds its result
    conv = _run([call("add", a=2, b=3), "it is 5"], [add])
    assert (conv.infos["rate/valid_call"], conv.infos["rate/result_in_answer"]) == (1.0, 1.0)
    # the result came back, the answer does not use it
    conv = _run([call("add", a=2, b=3), "it is 6"], [add])
    assert (conv.infos["rate/valid_call"], conv.infos["rate/result_in_answer"]) == (1.0, 0.0)
    # only malformed calls: no result to use, so no result rate; nor without any call
    conv = _run(["<tool_call>{bad</tool_call>", "error: it is"], [add])
    assert conv.infos["rate/valid_call"] == 0.0 and "rate/result_in_answer" not in conv.infos
    conv = _run(["5"], [add])
    assert conv.infos["rate/valid_call"] == 0.0 and "rate/result_in_answer" not in conv.infos


def test_tool_timeout_and_async_tools():
    conv = _run([call("slow", seconds=0.01), call("slow", seconds=30), "done"], [slow], tool_timeout_s=0.3)
    assert conv.messages[1].content == "awake"
    assert "ran past 0.3 s" in conv.messages[3].content and conv.status is Status.STOPPED
    assert conv.infos["tool_errors"] == 1


def test_call_budget_hands_replies_to_the_environment():
    conv = _run([call("add", a=1, b=1)] * 3, [add], max_calls=1)
    assert "limit of 1 reached" in conv.messages[1].content
    assert conv.messages[3].content == "judged"  # second call goes to the judge as an answer


# in the manner of Hermes / Qwen templates: the tools join the first system message, and a
# conversation without one gets a default system message
CHAT_WITH_TOOLS = (
    "{% set ns = namespace(tools='') %}{% if tools %}{% set ns.tools = '\n# Tools\n' %}"
    "{% for t in tools %}{% set ns.tools = ns.tools + (t | tojson) + '\n' %}{% endfor %}{% endif %}"
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou help.{{ ns.tools }}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if loop.first and m['role'] == 'system' %}{{ ns.tools }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_preamble_reproduces_the_template(tiny):
    from transformers import AutoTokenizer

    from interlens_mcore.assets.tiny import CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(tiny[1].name_or_path)
    tok.chat_template = CHAT_TEMPLATE  # the tiny tokenizer's first template, which ignores tools=
    schemas = [as_tool(add).schema]
    assert template_preamble(tok, schemas, "be brief") is None
    assert '"name": "add"' in tools_system_text(tok, schemas, "be brief")
    tok.chat_template = CHAT_WITH_TOOLS
    text = template_preamble(tok, schemas, "be brief")
    assert text.startswith("be brief") and "# Tools" in text and '"add"' in text
    # rendered on its own, the system message is what the template renders with tools=
    from interlens_mcore.chat import ChatFormat

    full = tok.apply_chat_template([{"role": "system", "content": "be brief"}], tools=schemas, tokenize=False)
    assert ChatFormat(tok).message_ids("system", text) == tok.encode(full, add_special_tokens=False)
    # no system message: the template's default one carries the tools
    default = template_preamble(tok, schemas)
    assert default.startswith("You help.\n# Tools\n") and '"add"' in default


def test_with_tools_end_to_end_on_a_dataset(tmp_path, tiny):
    model, tok = tiny
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"what is {i} + 1", "answer": i + 1}) for i in range(4)))
    src = ds_tasks.source(str(path), eval_fraction=0.25, tools="interlens_mcore.tools.examples:calculator")
    assert src.stop == ("</tool_call>",) and src.name == "dataset:q.jsonl+tools"
    rows = src.rows(2, seed=0)
    engine = ScriptEngine(tok, {"row0": [call("calculator", expression="1 + 1"), "2"], "row1": ["3"]})
    convs = play(rows, engine, tok)
    a, b = (c.trajectories()[0] for c in convs)
    assert a.infos["tool_calls"] == 1 and a.infos["tool_valid_calls"] == 1 and b.infos["tool_calls"] == 0
    assert rows[0].columns["answer"] in (1, 2, 3, 4)  # the row's other columns reach reward functions
    text = tok.decode(a.token_ids)
    assert "# Tools" not in text and '"name": "calculator"' in text  # plain preamble (tiny template)
    # the tool's result is in the view under mask 0; both replies are trained
    result_at = text.index("<|im_start|>tool\n2<|im_end|>")
    assert result_at > 0 and len(a.turns) == 2 and sum(a.loss_mask) == len(a.rollout_logprobs)
    masked = [i for i, m in enumerate(a.loss_mask) if m]
    assert tok.decode([a.token_ids[i] for i in masked]).count("calculator") == 1
    assert tool_metrics([a.infos, b.infos])["tool/calls_per_sample"] == 0.5
    assert tool_metrics([a.infos, b.infos])["tool/valid_fraction"] == 1.0


def test_with_tools_refuses_lineups_it_cannot_serve(tiny):
    src = with_tools(ta_tasks.source("TicTacToe-v0"), [calculator, python_eval])
    row = src.rows(1, seed=0)[0]
    with pytest.raises(ValueError, match="is not answered by an environment before it speaks again"):
        play([row], ScriptEngine(tiny[1], {}), tiny[1])
    with pytest.raises(ValueError, match="max_calls must be >= 1"):
        with_tools(src.source, [calculator], max_calls=0)


def test_a_hanging_sync_tool_is_cut_off():
    def hang(x: int) -> int:
        """Never returns in time.

        Args:
            x: anything
        """
        time.sleep(5)
        return x

    # a closure cannot be imported by a worker process: it runs in this process, in a thread
    start = time.monotonic()
    conv = _run([call("hang", x=1), "ok"], [hang], tool_timeout_s=0.2, isolation="thread")
    assert "ran past 0.2 s" in conv.messages[1].content and time.monotonic() - start < 3


def test_reasoning_gym_with_a_calculator(tiny):
    from interlens_mcore.tasks import reasoning_gym as rg

    src = with_tools(rg.source("basic_arithmetic", max_attempts=2), [calculator], tokenizer=tiny[1])
    row = src.rows(1, seed=0)[0]
    expression = row.entry["metadata"]["expression"]  # the wrapped row's fields stay readable
    value = calculator(expression)
    answer = row.entry["answer"]
    engine = ScriptEngine(
        tiny[1], {"row0": [call("calculator", expression=expression), f"<answer>{answer}</answer>"]}
    )
    conv = play([row], engine, tiny[1])[0]
    assert conv.messages[1].role == "tool" and conv.messages[1].content == value
    # the judge saw one attempt: the tool turn is not an answer
    assert (
        conv.infos["attempts"] == 1 and conv.infos["success"] == 1.0 and conv.infos["tool_valid_calls"] == 1
    )
    assert row.max_turns == 2 * 2 + 2 * 4 and src.trained_seats == ("policy",)
    assert src.describe()["tools"] == ["calculator"] and row.prompt()[0].role == "system"


def test_gym_with_tools_keeps_the_episode(tiny):
    from interlens_mcore.tasks import gym as gym_tasks

    src = with_tools(gym_tasks.source("FrozenLake-v1", is_slippery=False, max_steps=2), [python_eval])
    row = src.rows(1, seed=0)[0]
    engine = ScriptEngine(tiny[1], {"row0": [call("python_eval", expression="1 + 1"), "right", "down"]})
    conv = play([row], engine, tiny[1])[0]
    assert conv.messages[1].content == "2" and conv.infos["steps"] == 2 and conv.infos["tool_calls"] == 1
    assert conv.stop_reason == "episode over"  # (0, 1) -> (1, 1) is a hole


def test_tiny_model_rollout_with_tools(tiny):
    from interlens_mcore.engines.hf import HFEngine
    from interlens_mcore.tasks import reasoning_gym as rg

    model, tok = tiny
    src = with_tools(rg.source("basic_arithmetic"), [calculator], tokenizer=tok)
    convs = play(src.rows(3, seed=0), HFEngine(model, tok), tok, max_new_tokens=6)
    for c in convs:
        [t] = c.trajectories()
        assert c.infos["tool_calls"] == 0 and c.infos["attempts"] == 1  # a random model calls nothing
        # the template's own tools block (`assets.chat_templates`)
        assert tok.decode(t.token_ids).startswith("<|im_start|>system\nYou can call the functions below.")
        assert sum(t.loss_mask) == len(t.rollout_logprobs) > 0


def test_a_row_system_message_joins_the_tools_preamble(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}]}]
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(rows[0]))
    src = ds_tasks.source(str(path), prompt_column="messages", eval_fraction=0.0, tools=[calculator])
    opening = src.rows(1, seed=0)[0].prompt()
    assert [m.role for m in opening] == ["system", "user"]
    assert (
        opening[0].content.startswith("be terse\n\nYou may call tools.")
        and '"calculator"' in opening[0].content
    )


def test_calculator_demonstrations_call_the_tool_then_answer(tiny):
    from interlens_mcore.tasks import reasoning_gym as rg

    src = with_tools(rg.source("basic_arithmetic"), [calculator], tokenizer=tiny[1], isolation="thread")
    demos = src.demonstrations(6, seed=2)
    rows = {r.prompt()[-1].content: r for r in src.rows(48, seed=2)}
    assert len(demos) == 6
    for demo in demos:
        row = rows[demo[1]["content"]]  # the question, as the row asks it
        # the opening presents the tools exactly as the rollout's does
        assert demo[0] == {"role": "system", "content": row.prompt()[0].content}
        assert [m["role"] for m in demo] == ["system", "user", "assistant", "tool", "assistant"]
        [parsed] = HermesParser().parse(demo[2]["content"]).calls
        assert parsed.name == "calculator" and set(parsed.arguments) == {"expression"}
        assert demo[3]["content"] == calculator(parsed.arguments["expression"])
        replies = [demo[2]["content"], demo[4]["content"]]
        conv = play([row], ScriptEngine(tiny[1], {"row0": replies}), tiny[1])[0]
        # the rollout runs the same call to the same result, and the row's rule scores the answer 1
        assert conv.messages[1].content == demo[3]["content"] and conv.infos["success"] == 1.0
        assert conv.infos["tool_valid_calls"] == 1


def test_demonstrations_need_an_expression_tool(tiny):
    from interlens_mcore.tasks import reasoning_gym as rg

    src = with_tools(rg.source("basic_arithmetic"), [python_eval], tokenizer=tiny[1], isolation="thread")
    assert len(src.demonstrations(2, seed=0)) == 2  # python_eval takes one `expression` too

    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: the key
        """
        return key

    with pytest.raises(NotImplementedError, match="one `expression` argument"):
        with_tools(rg.source("basic_arithmetic"), [lookup], isolation="thread").demonstrations(2, seed=0)
