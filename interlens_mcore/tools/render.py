"""The system message that presents tools to a policy.

A chat template that takes `tools=` renders the schemas into its first system message. A
conversation renders every message once, on its own (`ChatFormat.message_ids`), so the
tools are carried by a system message whose content is exactly what the template put there:
rendering `[system?, user]` with and without `tools=` and cutting the system frame off gives
that content, and `message_ids("system", content)` reproduces the template's text. A
template that ignores `tools=` (it renders the same either way) gets `plain_preamble`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .tool import ToolSchema

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_PROBE = "\x00user-probe\x00"


def plain_preamble(schemas: Sequence[ToolSchema], system: str | None = None) -> str:
    """Tool schemas and the call format as plain text, after `system` when given."""
    lines = [system, ""] if system else []
    lines += [
        "You may call tools. To call one, write exactly",
        '<tool_call>{"name": "TOOL_NAME", "arguments": {"ARGUMENT": VALUE}}</tool_call>',
        "and stop; its result comes back as the next message. Answer without a tool call when done.",
        "Tools:",
    ]
    lines += [json.dumps(s.get("function", s), sort_keys=True) for s in schemas]
    return "\n".join(lines)


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], tools: Sequence[ToolSchema] | None
) -> str:
    listed: list[dict[str, object] | Callable[..., object]] | None = None
    if tools is not None:
        listed = [dict(t) for t in tools]
    text = tokenizer.apply_chat_template(messages, tools=listed, tokenize=False, add_generation_prompt=False)
    assert isinstance(text, str), "apply_chat_template(tokenize=False) renders text"
    return text


def template_preamble(
    tokenizer: PreTrainedTokenizerBase, schemas: Sequence[ToolSchema], system: str | None = None
) -> str | None:
    """The system content the chat template gives `schemas` (and `system`), or None if it has none."""
    opening = [{"role": "system", "content": system}] if system else []
    user = [{"role": "user", "content": _PROBE}]
    with_tools = _render(tokenizer, opening + user, list(schemas))
    if with_tools == _render(tokenizer, opening + user, None):
        return None  # the template ignores tools=
    # the user message as the template renders it after a system message (a template may add a
    # default system message before a lone user message, so it is not the lone rendering)
    probe_system = [{"role": "system", "content": "s"}]
    before = _render(tokenizer, probe_system, None)
    after = _render(tokenizer, probe_system + user, None)
    if not after.startswith(before) or not with_tools.endswith(after[len(before) :]):
        return None
    prefix = with_tools[: len(with_tools) - (len(after) - len(before))]
    head, _, tail = _render(tokenizer, [{"role": "system", "content": _PROBE}], None).partition(_PROBE)
    if len(prefix) < len(head) + len(tail) or not (prefix.startswith(head) and prefix.endswith(tail)):
        return None  # the tools are not inside one system message
    return prefix[len(head) : len(prefix) - len(tail)]


def tools_system_text(
    tokenizer: PreTrainedTokenizerBase | None, schemas: Sequence[ToolSchema], system: str | None = None
) -> str:
    """The system message content presenting `schemas`: the template's own, else `plain_preamble`."""
    text = template_preamble(tokenizer, schemas, system) if tokenizer is not None else None
    return plain_preamble(schemas, system) if text is None else text
