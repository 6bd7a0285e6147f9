"""What a model-based reward reads of a trajectory: its messages, its prompt, the row's columns.

- `chat_messages(t)`: the transcript as `{"role", "content"}` dicts (what a chat template takes);
- `prompt_text(t)`: the contents of the messages before the seat's last one, a line apart;
- `row_columns(row)`: a dataset row's columns (a mapping's items, a dataclass's fields).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..types import Trajectory


def chat_messages(t: Trajectory) -> list[dict[str, str]]:
    """The transcript as the seat saw it, as `{"role", "content"}` dicts."""
    return [
        {"role": str(m.get("role", "user")), "content": str(m.get("content", ""))} for m in t.infos.messages
    ]


def prompt_text(t: Trajectory) -> str:
    """The contents of the messages before the seat's last one (its completion), a line apart.

    The seat's last message is the last assistant message holding the completion: in a
    multi-turn game an environment's reply may follow it, and is not part of the prompt.
    """
    messages = chat_messages(t)
    seat = {"role": "assistant", "content": t.infos.completion}
    last = [i for i, m in enumerate(messages) if m == seat]
    return "\n".join(m["content"] for m in (messages[: last[-1]] if last else messages))


def row_columns(row: object) -> dict[str, object]:
    """A row's columns by name: a mapping's items or a dataclass's fields; {} for anything else."""
    if isinstance(row, Mapping):
        return {str(k): v for k, v in row.items()}
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}
    return {}
