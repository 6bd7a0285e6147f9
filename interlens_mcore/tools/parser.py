"""Tool calls parsed from a policy's sampled text.

The default format is the one Hermes and Qwen chat templates teach their models: each call a
JSON object with a `name` and an `arguments` object, between `<tool_call>` and
`</tool_call>`::

    I will add them. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>

A parser returns every well-formed call and one error message per malformed one, so the
policy is told what was wrong instead of the step failing. The last block may lack its
closing tag: sampling stops at `</tool_call>` (`HermesParser.stop`), and engines that drop the
stop string leave the call unclosed.

Another format plugs in as any object with `parse(text) -> ParsedCalls` and a `stop` tuple.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One well-formed call: a tool name and its keyword arguments."""

    name: str
    arguments: dict[str, object] = field(default_factory=dict)  # a JSON object


@dataclass(frozen=True, kw_only=True)
class ParsedCalls:
    """What a reply asked for: the well-formed calls, and a message per malformed one."""

    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def attempted(self) -> int:
        """Calls the reply tried to make, well-formed or not."""
        return len(self.calls) + len(self.errors)


class ToolCallParser(Protocol):
    """`parse(text)` finds the calls of one reply; `stop` ends a policy turn after a call."""

    @property
    def stop(self) -> tuple[str, ...]: ...

    def parse(self, text: str) -> ParsedCalls: ...


@dataclass(frozen=True)
class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, in order.

    Rules: a block's body must be one JSON object with a non-empty string `name` and, if
    present, an object `arguments` (a JSON string holding an object is accepted too: some
    models emit it that way); other keys are an error. A stray `</tool_call>` with no opening
    tag, or an opening tag inside a block, is an error. A reply with no tags makes no calls.
    """

    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"
    max_calls: int = 8  # per reply; more are errors, so a reply cannot fan out without bound

    @property
    def stop(self) -> tuple[str, ...]:
        return (self.close_tag,)

    def parse(self, text: str) -> ParsedCalls:
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            stray = text.find(self.close_tag, pos)
            if stray != -1 and (start == -1 or stray < start):
                errors.append(f"{self.close_tag} at character {stray} closes no {self.open_tag}")
                pos = stray + len(self.close_tag)
                continue
            if start == -1:
                break
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            body = text[body_start:] if end == -1 else text[body_start:end]
            pos = len(text) if end == -1 else end + len(self.close_tag)
            if self.open_tag in body:
                errors.append(f"{self.open_tag} at character {start} is not closed before the next one")
                pos = body_start + body.index(self.open_tag)
                continue
            if len(calls) + len(errors) >= self.max_calls:
                errors.append(f"more than {self.max_calls} tool calls in one reply")
                continue
            call, error = _call_from_json(body)
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        return ParsedCalls(calls=tuple(calls), errors=tuple(errors))


def _call_from_json(body: str) -> tuple[ToolCall | None, str]:
    body = body.strip()
    if not body:
        return None, "empty tool call: expected a JSON object with 'name' and 'arguments'"
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        return None, f"tool call is not valid JSON ({msg}): {_clip(body)}"
    if not isinstance(obj, dict):
        return None, f"tool call must be a JSON object, got {type(obj).__name__}: {_clip(body)}"
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return None, f"tool call has unknown keys {extra}; expected only 'name' and 'arguments'"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f"tool call needs a non-empty string 'name', got {name!r}"
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return None, f"tool call {name!r}: 'arguments' is a string that is not a JSON object"
    if not isinstance(args, dict):
        return None, f"tool call {name!r}: 'arguments' must be an object, got {type(args).__name__}"
    return ToolCall(name=name.strip(), arguments=args), ""


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + "..."
