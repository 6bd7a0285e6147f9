"""Tool-capable chat templates of the shipped tokenizers (tiny Qwen2, the default policy, SmolLM2).

A conversation without tools renders byte for byte as under the tokenizers' first templates
(`<|im_start|>ROLE\\nCONTENT<|im_end|>\\n` per message, SmolLM2's default system message
before a first message that is not a system one), so models, rollouts and figures made with
those templates are unchanged. What the templates add is the tool-calling conversation that
TRL checks before it accepts `tools=` or `environment_factory`
(`trl.chat_template_utils.supports_tool_calling`), in the Hermes / Qwen2 form that
`tools.HermesParser` reads:

- `tools=`: the schemas, one JSON object a line, in the first system message (after the
  system text the conversation gives, or the template's default one);
- an assistant message's `tool_calls`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  after its content;
- a `tool` message: `<|im_start|>tool\\nCONTENT<|im_end|>\\n`, as every other role.

`RESPONSE_TEMPLATE` tells transformers' `parse_response` (which TRL's tool loop calls) how to
read a reply back. `with_tool_template(tokenizer)` gives a tokenizer loaded from an asset folder
built before these templates existed (a cache keeps its folder) the new template: it
recognises the first templates by their SHA-256 and leaves any other template alone.
"""

from __future__ import annotations

import hashlib
from typing import Any

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# what the tools block says around the schemas (the call format is the parser's)
TOOLS_INTRO = "You can call the functions below. Each line is one function's JSON schema:\n<tools>\n"
TOOLS_OUTRO = (
    '</tools>\nTo call one, write <tool_call>{"name": FUNCTION_NAME, "arguments": '
    "{ARGUMENT: VALUE}}</tool_call> and stop; its result comes back in a tool message."
)


def _j(text: str) -> str:
    """`text` as a jinja string literal (single-quoted)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def tool_template(default_system: str | None = None) -> str:
    """The jinja template: `default_system` is the system text put first when the first message
    is not a system one (None: no default system message, as the tiny tokenizer's template)."""
    first_is_system = "messages and messages[0]['role'] == 'system'"
    tools_block = "{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}"
    system = "{{ messages[0]['content'] }}{{ '\\n\\n' }}"
    if default_system is None:
        lead, default = f"{{% if {first_is_system} %}}{system}{{% endif %}}", ""
    else:
        fallback = f"{{{{ {_j(default_system + chr(10) * 2)} }}}}"
        lead = f"{{% if {first_is_system} %}}{system}{{% else %}}{fallback}{{% endif %}}"
        # the default system message of a conversation without tools, as the first template has it
        default = (
            "{% if not tools and loop.first and messages[0]['role'] != 'system' %}"
            f"{{{{ {_j('<|im_start|>system' + chr(10) + default_system + '<|im_end|>' + chr(10))} }}}}"
            "{% endif %}"
        )
    opening = (
        f"{{% if tools %}}<|im_start|>system\n{lead}{{{{ {_j(TOOLS_INTRO)} }}}}{tools_block}"
        f"{{{{ {_j(TOOLS_OUTRO)} }}}}<|im_end|>\n{{% endif %}}"
    )
    call = (
        "{% set f = c['function'] if c['function'] is defined else c %}"
        "<tool_call>{{ '{\"name\": ' }}{{ f['name'] | tojson }}{{ ', \"arguments\": ' }}"
        "{% if f['arguments'] is string %}{{ f['arguments'] }}"
        "{% else %}{{ f['arguments'] | tojson }}{% endif %}"
        "{{ '}' }}</tool_call>"
    )
    body = (
        "{% for m in messages %}"
        f"{default}"
        "{% if tools and loop.first and m['role'] == 'system' %}"  # already in the tools block
        "{% elif m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] %}"
        "<|im_start|>assistant\n{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
        f"{{% for c in m['tool_calls'] %}}{call}{{% endfor %}}<|im_end|>\n"
        "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return opening + body


TINY_TEMPLATE = tool_template()
SMOLLM2_TEMPLATE = tool_template(SMOLLM2_SYSTEM)

# transformers' `response_template` form: an assistant reply's text, then its calls
RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

# SHA-256 of the templates the asset folders were first built with -> the template replacing it
FIRST_TEMPLATES = {
    "9a6ac2cf411f21cf1fa155617d146256deee33e64c43eace6c36fd9eb3dd5a2a": TINY_TEMPLATE,  # tiny, policy
    "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788": SMOLLM2_TEMPLATE,
}


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def with_tool_template(tokenizer: Any) -> Any:
    """`tokenizer` with the tool-capable template and `RESPONSE_TEMPLATE` if its template is one
    of the first templates of the assets (`FIRST_TEMPLATES`); any other tokenizer as it is."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        new = FIRST_TEMPLATES.get(sha256(template))
        if new is not None:
            tokenizer.chat_template = new
            if getattr(tokenizer, "response_template", None) is None:
                tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer
