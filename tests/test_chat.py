"""ChatFormat renders each message once; its fast path must equal the full template render."""

import copy

import pytest

from interlens_mcore.chat import ChatFormat


@pytest.mark.parametrize("role", ["user", "tool", "system"])
@pytest.mark.parametrize("content", ["hi there", " spaced ", "two\nlines {{ x }}", ""])
def test_message_ids_equal_a_full_render(tiny, role, content):
    _, tok = tiny
    chat = ChatFormat(tok)
    full = tok.encode(
        tok.apply_chat_template([{"role": role, "content": content}], tokenize=False),
        add_special_tokens=False,
    )
    assert chat.message_ids(role, content) == full


def test_a_template_that_edits_content_is_rendered_in_full(tiny):
    _, tok = tiny
    trimming = copy.deepcopy(tok)
    trimming.chat_template = tok.chat_template.replace("m['content']", "m['content'] | trim")
    chat = ChatFormat(trimming)
    assert chat.message_ids("user", "  x  ") == chat.message_ids("user", "x")
    assert chat._frames["user"] is None  # the fast path noticed the edit and stands aside


def test_turn_pieces_compose_an_assistant_message(tiny):
    _, tok = tiny
    chat = ChatFormat(tok)
    sampled = tok.encode("42", add_special_tokens=False) + [tok.eos_token_id]
    turn = chat.generation_prompt_ids() + sampled + chat.close_ids("stop")
    assert turn == chat.message_ids("assistant", "42")
    cut = chat.generation_prompt_ids() + sampled[:-1] + chat.close_ids("length")
    assert cut == chat.message_ids("assistant", "42")


def test_tokenizer_without_template_is_refused(tiny):
    _, tok = tiny
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        ChatFormat(bare)
