"""Chat templates for the tests, derived from the tiny tokenizer's (no network, no model)."""

from __future__ import annotations

import copy

DEFAULT_SYSTEM = "You are a careful assistant."


def default_system_template(tok):
    """The tiny template plus a default system block before a first message that is not one
    (as SmolLM2's and Qwen2.5's templates do)."""
    opening = (
        "{% if loop.first and messages[0]['role'] != 'system' %}"
        "<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n{% endif %}"
    )
    templated = copy.deepcopy(tok)
    templated.chat_template = tok.chat_template.replace(
        "{% for m in messages %}", "{% for m in messages %}" + opening
    )
    assert templated.chat_template != tok.chat_template
    return templated


def named_template(tok):
    """The tiny template with a `name` field: `<|im_start|>user (player_b)`."""
    named = copy.deepcopy(tok)
    named.chat_template = tok.chat_template.replace(
        "{{ m['role'] }}", "{{ m['role'] }}{{ ' (' ~ m.name ~ ')' if m.name is defined else '' }}"
    )
    assert named.chat_template != tok.chat_template
    return named
