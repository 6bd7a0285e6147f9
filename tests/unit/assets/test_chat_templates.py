"""The tool-capable templates: conversations without tools render as under the first templates,
and TRL accepts them for tools and environments."""

import json

import pytest
from transformers import AutoTokenizer
from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

from interlens_mcore.assets import ensure_default_policy
from interlens_mcore.assets.chat_templates import (
    FIRST_TEMPLATES,
    SMOLLM2_SYSTEM,
    SMOLLM2_TEMPLATE,
    TINY_TEMPLATE,
    sha256,
    with_tool_template,
)
from interlens_mcore.assets.tiny import CHAT_TEMPLATE
from interlens_mcore.tools import HermesParser

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 + 3"}],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "guess", "name": "game"},
        {"role": "assistant", "content": "50", "name": "policy"},
        {"role": "user", "content": "higher\n", "name": "game"},
    ],
    [{"role": "assistant", "content": "I open"}, {"role": "user", "content": " spaced  "}],
    [{"role": "user", "content": "q"}, {"role": "tool", "content": "4", "name": "calculator"}],
]


def first_rendering(messages, generation_prompt: bool, default_system: str | None) -> str:
    """What the first templates render, written out: `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n` per
    message, SmolLM2's default system message before a first message that is not a system one."""
    out = ""
    if default_system is not None and messages[0]["role"] != "system":
        out += f"<|im_start|>system\n{default_system}<|im_end|>\n"
    out += "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if generation_prompt else "")


@pytest.fixture(scope="module")
def tokenizers(tiny_path, smollm2_path):
    """name -> (tokenizer as loaded from its asset folder, the default system text of its template)."""
    folders = {"tiny": tiny_path, "policy": ensure_default_policy(), "smollm2": smollm2_path}
    return {
        name: (AutoTokenizer.from_pretrained(folder), SMOLLM2_SYSTEM if name == "smollm2" else None)
        for name, folder in folders.items()
    }


@pytest.mark.parametrize("name", ["tiny", "policy", "smollm2"])
def test_conversations_without_tools_render_as_before(tokenizers, name):
    loaded, default_system = tokenizers[name]
    before = loaded.chat_template
    # a cached folder keeps its first template; a folder built now has the tool-capable one
    assert sha256(before) in FIRST_TEMPLATES or before in (TINY_TEMPLATE, SMOLLM2_TEMPLATE)
    tok = with_tool_template(AutoTokenizer.from_pretrained(loaded.name_or_path))
    assert tok.chat_template == (SMOLLM2_TEMPLATE if default_system else TINY_TEMPLATE)
    for messages in CONVERSATIONS:
        for gen in (False, True):
            want = first_rendering(messages, gen, default_system)
            assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == want
            old = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert old == want  # the first template (or, in a fresh folder, the same new one)
            ids = tok.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=gen, return_dict=False
            )
            assert list(ids) == tok.encode(want, add_special_tokens=False)


def test_the_tiny_first_template_is_the_one_recognised():
    assert FIRST_TEMPLATES[sha256(CHAT_TEMPLATE)] == TINY_TEMPLATE


@pytest.mark.parametrize("name", ["tiny", "policy", "smollm2"])
def test_trl_accepts_the_templates_for_tools(tokenizers, name):
    loaded, default_system = tokenizers[name]
    tok = with_tool_template(AutoTokenizer.from_pretrained(loaded.name_or_path))
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@pytest.mark.parametrize("name", ["tiny", "smollm2"])
def test_a_tool_conversation_in_the_parsers_form(tokenizers, name):
    loaded, default_system = tokenizers[name]
    tok = with_tool_template(AutoTokenizer.from_pretrained(loaded.name_or_path))
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": "3"},
    ]
    text = tok.apply_chat_template(messages, tools=[add], tokenize=False, add_generation_prompt=True)
    system, rest = text.split("<|im_end|>\n", 1)
    # the schemas in the first system message, after its own text; one JSON object a line
    assert system.startswith("<|im_start|>system\nbe brief\n\n")
    [line] = [ln for ln in system.splitlines() if ln.startswith("{")]
    assert json.loads(line)["function"]["name"] == "add"
    reply = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert rest == (
        "<|im_start|>user\n1 + 2?<|im_end|>\n"
        f"<|im_start|>assistant\n{reply}<|im_end|>\n"
        "<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    )
    [parsed] = HermesParser().parse(reply).calls
    assert parsed.name == "add" and parsed.arguments == {"a": 1, "b": 2}
    # transformers reads it back as TRL's tool loop does
    back = tok.parse_response(f"ok {reply}<|im_end|>", prefix="<|im_start|>assistant\n")
    assert back["tool_calls"] == [call] and back["content"] == "ok"
    # without a system message, the template's default one (SmolLM2's) or none carries the tools
    alone = tok.apply_chat_template(messages[1:2], tools=[add], tokenize=False)
    head = f"<|im_start|>system\n{default_system}\n\n" if default_system else "<|im_start|>system\nYou can"
    assert alone.startswith(head) and '"name": "add"' in alone


def test_a_fresh_build_saves_the_tool_template(tmp_path, tiny_path):
    from interlens_mcore.assets.chat_templates import RESPONSE_TEMPLATE
    from interlens_mcore.assets.tiny import build_tokenizer

    build_tokenizer(tmp_path)
    fresh, cached = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tiny_path)
    assert fresh.chat_template == TINY_TEMPLATE and fresh.response_template == RESPONSE_TEMPLATE
    assert with_tool_template(fresh).chat_template == TINY_TEMPLATE  # recognised as it is: unchanged
    # the same text as the cached folder's tokenizer under its own template (the ids also depend on
    # the tokenizer class, which a folder without a model config does not choose)
    for messages in CONVERSATIONS:
        for gen in (False, True):
            texts = {
                t.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
                for t in (fresh, cached)
            }
            assert len(texts) == 1
