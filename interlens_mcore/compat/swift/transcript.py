"""From an ms-swift scheduler's mutated messages to the token ids appended to the request.

ms-swift re-renders the whole transcript every turn; here the ids the engine saw only grow.
After a step, the messages are compared with the transcript as it stood when the reply was
appended: messages added after it are rendered once each and appended (after the template's
closing ids, before the next assistant opener); text added to the reply itself (a
continuation) is encoded once and appended. Sampled ids are never re-tokenized. Anything else
(an earlier message edited or removed, the reply rewritten without `response_token_ids` that
say what it became) cannot be expressed by appending, and raises `HistoryRewriteError`.

A trailing `{"role": "assistant", "content": None}` is ms-swift's placeholder for "the
assistant speaks here": it is dropped, so after an assistant message it continues that
message, after any other message it opens a new one.
"""

from __future__ import annotations

from ... import ChatFormat
from .types import Message


class HistoryRewriteError(ValueError):
    """A step changed messages the engine already conditioned on."""


def is_placeholder(message: Message) -> bool:
    return message.get("role") == "assistant" and message.get("content") is None


def without_placeholder(messages: list[Message]) -> list[Message]:
    return messages[:-1] if messages and is_placeholder(messages[-1]) else list(messages)


def append_completion(messages: list[Message], text: str) -> bool:
    """Add the reply to `messages` in place, as ms-swift does; True when it continued a message."""
    if messages and is_placeholder(messages[-1]):
        messages.pop()
    if messages and messages[-1].get("role") == "assistant":
        messages[-1]["content"] = _text(messages[-1], len(messages) - 1, "request") + text
        return True
    messages.append({"role": "assistant", "content": text})
    return False


def _text(message: object, i: int, where: str) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where}: messages[{i}] must be a dict with a 'role', got {message!r}")
    content = message.get("content")
    if not isinstance(content, str):
        raise ValueError(
            f"{where}: messages[{i}] ({message['role']}) content must be a str, got {type(content).__name__}"
        )
    return content


def native_messages(messages: list[Message], where: str) -> list[dict[str, str]]:
    """The text transcript the native driver keeps (role and content only)."""
    return [{"role": m["role"], "content": _text(m, i, where)} for i, m in enumerate(messages)]


def _render(chat: ChatFormat, messages: list[Message], offset: int, where: str) -> tuple[list[int], bool]:
    """Ids of `messages` rendered once each, then the assistant opener; True if the last is a prefill.

    A last assistant message is the start of the reply (a prefill): it is opened, not closed,
    and the engine continues it.
    """
    ids: list[int] = chat.preamble_ids(messages[0]["role"]) if messages and offset == 0 else []
    for i, m in enumerate(messages[:-1] if messages else []):
        ids += chat.message_ids(m["role"], _text(m, offset + i, where))
    last = messages[-1] if messages else None
    prefill = last is not None and last.get("role") == "assistant"
    if last is not None and not prefill:
        ids += chat.message_ids(last["role"], _text(last, offset + len(messages) - 1, where))
    ids += chat.generation_prompt_ids()
    if prefill:
        ids += chat.encode(_text(last, offset + len(messages) - 1, where))
    return ids, prefill


def prompt_ids(chat: ChatFormat, messages: list[Message], where: str) -> list[int]:
    """The first turn's prompt: every message rendered once, the assistant's turn opened."""
    messages = without_placeholder(messages)
    if not messages:
        raise ValueError(f"{where}: messages is empty (on_trajectory_start or the row must give some)")
    return _render(chat, messages, 0, where)[0]


def _describe(message: object) -> str:
    if not isinstance(message, dict):
        return repr(message)
    content = message.get("content")
    text = content if not isinstance(content, str) or len(content) <= 40 else content[:37] + "..."
    return f"{message.get('role')}: {text!r}"


def extension(
    chat: ChatFormat,
    before: list[Message],
    after: list[Message],
    response_ids: list[int],
    *,
    ids_given: bool,
    where: str,
) -> list[int]:
    """Ids to append after `response_ids` so the prompt says what `after` says.

    `before` ends with the assistant reply of this turn; `ids_given` says the step returned
    `response_token_ids`, which then stand for the reply whatever its text became.
    """
    after = without_placeholder(after)
    n = len(before)
    for i in range(n - 1):
        if i >= len(after) or after[i] != before[i]:
            now = "removed" if i >= len(after) else f"now {_describe(after[i])}"
            raise HistoryRewriteError(
                f"{where}: step() changed messages[{i}] ({_describe(before[i])}, {now}), which the engine "
                "already conditioned on; a step may only append messages or text to the last reply "
                "(a scheduler that rewrites history needs the native MultiTurnScheduler)"
            )
    if len(after) < n or after[n - 1].get("role") != "assistant":
        now = "removed" if len(after) < n else f"now {_describe(after[n - 1])}"
        raise HistoryRewriteError(f"{where}: step() replaced the reply messages[{n - 1}] ({now})")
    old, new = _text(before[n - 1], n - 1, where), _text(after[n - 1], n - 1, where)
    appended = ""
    if not ids_given:
        if not new.startswith(old):
            raise HistoryRewriteError(
                f"{where}: step() rewrote the reply messages[{n - 1}] ({_describe(before[n - 1])}, now "
                f"{_describe(after[n - 1])}); append text to it, or return response_token_ids saying "
                "what it is in tokens"
            )
        appended = new[len(old) :]
    added = after[n:]
    if not added:  # the reply continues: only the appended text, encoded once
        return chat.encode(appended) if appended else []
    if appended:
        raise HistoryRewriteError(
            f"{where}: step() appended text to the reply messages[{n - 1}] and then more messages; "
            "return response_token_ids for the changed reply, or append the text as a message"
        )
    closed = bool(response_ids) and response_ids[-1] in chat.stop_token_ids
    return chat.close_ids("stop" if closed else "length") + _render(chat, added, n, where)[0]
