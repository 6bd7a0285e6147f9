"""Rendering messages into token ids through a tokenizer's chat template, once per message."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

_PROBE = "\x00probe\x00"
_ANCHOR = "\x00anchor\x00"
_NAME = "\x00seat\x00"


class Tokenizer(Protocol):
    """What this package uses of a transformers tokenizer with a chat template.

    Return types are as broad as transformers declares them; `ChatFormat` narrows them.
    """

    @property
    def chat_template(self) -> str | None: ...

    @property
    def eos_token(self) -> str | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def pad_token_id(self) -> int | None: ...

    @property
    def all_special_tokens(self) -> list[str]: ...

    @property
    def name_or_path(self) -> str: ...

    def __len__(self) -> int: ...

    def apply_chat_template(
        self, conversation: list[dict[str, str]], *, tokenize: bool = ..., add_generation_prompt: bool = ...
    ) -> object: ...

    def encode(
        self, text: str, *, add_special_tokens: bool = ..., split_special_tokens: bool = ...
    ) -> list[int]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...) -> object: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> str | list[str]: ...


@dataclass
class ChatFormat:
    """Splits a chat template into per-message pieces so a view can grow by appending.

    Every non-sampled message is rendered on its own (`message_ids`); a policy turn is
    `generation_prompt_ids` + sampled ids + `close_ids(finish_reason)`. Rendering a message once
    and never again is what keeps the training sequence equal to what the engine saw.

    A message's ids are those the template gives it inside a conversation, not at its start:
    what a template puts only before the first message (a default system block when the first
    message is not a system one, as SmolLM2's and Qwen2.5's templates do; a bos token) is
    `preamble_ids(first_role)`, added once by whoever opens a conversation: `conversation_ids`
    for opening messages; a `Conversation` view or a `MultiTurnRequest` with none before the
    first message it appends (a policy's own turn opens it as "assistant").
    """

    tokenizer: Tokenizer  # a transformers tokenizer with a chat template
    _cache: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _frames: dict[str, tuple[str, str] | None] = field(default_factory=dict, repr=False)
    _anchors: dict[str, str | None] = field(default_factory=dict, repr=False)
    _names: bool | None = field(default=None, repr=False)  # renders_names, once probed

    def __post_init__(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("ChatFormat needs a tokenizer with a chat_template")
        eos = self.tokenizer.eos_token
        if self.tokenizer.eos_token_id is None or eos is None:
            raise ValueError("ChatFormat needs a tokenizer with an eos_token (end of turn)")
        self._eos = eos
        self._control = tuple(t for t in self.tokenizer.all_special_tokens if t)  # control strings
        one = [{"role": "user", "content": _PROBE}]
        plain = self._render(one, add_generation_prompt=False)
        with_prompt = self._render(one, add_generation_prompt=True)
        if not with_prompt.startswith(plain):
            raise ValueError("chat template: the generation prompt must extend the rendering")
        self._gen_prompt_text = with_prompt[len(plain) :]
        assistant = self._render([{"role": "assistant", "content": _PROBE}], False)
        self._assistant_tail = assistant[assistant.index(_PROBE) + len(_PROBE) :]
        if not self._assistant_tail.startswith(eos):
            raise ValueError(f"chat template: an assistant message must end with the eos token {eos!r}")

    def _in_context(self, message: dict) -> str:
        """The text `message` adds to a conversation it does not open.

        Found as the difference between a conversation of one anchor message and that
        conversation with `message` after it; a template that refuses the anchor (or renders
        the conversation so that it does not extend) gets the message rendered alone.
        """
        for role in ("system", "user"):
            anchor = {"role": role, "content": _ANCHOR}
            if role not in self._anchors:  # rendered once: the slow path renders every message
                try:
                    self._anchors[role] = self._render([anchor], False)
                except Exception:  # e.g. a template that raises on a system message
                    self._anchors[role] = None
            before = self._anchors[role]
            if before is None:
                continue
            try:
                after = self._render([anchor, message], False)
            except Exception:
                continue
            if after.startswith(before):
                return after[len(before) :]
        return self._render([message], False)

    def preamble_ids(self, first_role: str = "user") -> list[int]:
        """Ids the template puts before the first message when that one has `first_role`."""
        key = f"preamble:{first_role}"
        if key not in self._cache:
            probe = {"role": first_role, "content": _PROBE}
            alone, piece = self._render([probe], False), self._in_context(probe)
            self._cache[key] = self.encode(alone[: -len(piece)]) if piece and alone.endswith(piece) else []
        return list(self._cache[key])

    def conversation_ids(self, messages: list[dict]) -> list[int]:
        """Ids of whole messages ({"role", "content"[, "name"]}) opening a conversation."""
        if not messages:
            return []
        ids = self.preamble_ids(messages[0]["role"])
        for m in messages:
            ids += self.message_ids(m["role"], m["content"], name=m.get("name"))
        return ids

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return _text(text, "apply_chat_template(tokenize=False)")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` read as plain text: control strings in it (`<|im_end|>`) are not tokens."""
        if not self._has_control_text(text):
            return self.encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def _has_control_text(self, text: str) -> bool:
        return any(t in text for t in self._control)

    def message_ids(self, role: str, content: str, *, name: str | None = None) -> list[int]:
        """Token ids of one message inside a conversation; its content is text, never control.

        `name` (the speaker's seat) goes to the template's `name` field; a template that
        ignores it (`renders_names` is False) renders the message as if it were absent, so
        `Conversation(seat_names="field")` refuses such a template.
        """
        frame = self._frame(role) if name is None else None
        if frame is None:
            message = {"role": role, "content": content, **({"name": name} if name is not None else {})}
            if self._has_control_text(content):
                raise ValueError(
                    f"message of role {role!r} holds control text of the chat template ({content[:40]!r}) "
                    "and this template cannot be split around the content; remove it from the message"
                )
            return self.encode(self._in_context(message))
        if self._has_control_text(content):  # the frame is control, the content is text
            return self.encode(frame[0]) + self.encode_text(content) + self.encode(frame[1])
        return self.encode(frame[0] + content + frame[1])

    @property
    def renders_names(self) -> bool:
        """Does the template render a message's `name` field (the speaker's seat)?"""
        if self._names is None:
            message = {"role": "user", "content": _PROBE, "name": _NAME}
            try:
                self._names = _NAME in self._render([message], False)
            except Exception:  # a template that refuses the field does not render it either
                self._names = False
        return self._names

    def _frame(self, role: str) -> tuple[str, str] | None:
        """(text before, text after) the content, when the template inserts content verbatim.

        Rendering a template costs far more than tokenizing, and a rollout renders every
        environment message once per policy view; so the frame is found once per role and
        checked with two probes (whitespace included, so a template that strips or edits the
        content is noticed and rendered in full every time instead).
        """
        if role not in self._frames:
            probes = [" \x00a\x00 ", "\x00bb\x00\n"]
            renders = [self._in_context({"role": role, "content": p}) for p in probes]
            head = renders[0].split(probes[0])[0]
            tail = renders[0][len(head) + len(probes[0]) :]
            ok = all(r == head + p + tail for p, r in zip(probes, renders))
            self._frames[role] = (head, tail) if ok else None
        return self._frames[role]

    def generation_prompt_ids(self) -> list[int]:
        """Ids that open an assistant turn (e.g. `<|im_start|>assistant\\n`)."""
        if "gen" not in self._cache:
            self._cache["gen"] = self.encode(self._gen_prompt_text)
        return list(self._cache["gen"])

    def close_ids(self, finish_reason: str | None) -> list[int]:
        """Ids the template puts after a sampled turn: after eos if it stopped, else eos too."""
        key = "close_stop" if finish_reason == "stop" else "close_length"
        if key not in self._cache:
            tail = self._assistant_tail
            if finish_reason == "stop":
                tail = tail[len(self._eos) :]
            self._cache[key] = self.encode(tail)
        return list(self._cache[key])

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        eos = self.tokenizer.eos_token_id
        assert eos is not None, "__post_init__ refuses a tokenizer without an eos token"
        return (eos,)

    def decode(self, ids: list[int]) -> str:
        return _text(self.tokenizer.decode(ids, skip_special_tokens=True), "decode")


def _text(value: object, call: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"tokenizer.{call} returned {type(value).__name__}; expected str")
    return value
