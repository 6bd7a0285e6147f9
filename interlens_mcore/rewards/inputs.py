"""What TRL and ms-swift reward functions read, taken from our trajectories and rows.

- `columns_of(row)`: every dataset column of the row (a `--dataset` row's `columns`, a
  reasoning-gym entry's `question` / `answer` / `metadata`, an ms-swift row's own keys).
- the prompt and completion of a trajectory: the seat's transcript (`infos.messages`) split at
  its first assistant message, as `{"role", "content"}` messages (conversational), or as text:
  the prompt's last user message and the seat's last message (`infos.completion`).
- `completion_ids`: the token ids the seat sampled in its last turn.

Text or conversational (TRL's rule, made ours): text when the row is a `--dataset` row whose
prompt cell is a string (TRL: the dataset's prompt is text), conversational otherwise (message
lists in the dataset, and every multi-turn, game, reasoning-gym or scheduler task: they are
chats).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from ..tasks.dataset import PromptRow
from ..types import ChatMessage, Trajectory

# what TRL passes itself, never as a column (TRL drops the same keys from the dataset's)
RESERVED = ("prompt", "completion", "completion_ids", "prompts", "completions")


@runtime_checkable
class HasColumns(Protocol):
    """A row type that names its dataset columns (`PromptRow`, a reasoning-gym task)."""

    @property
    def columns(self) -> Mapping[str, object]: ...


def columns_of(row: object) -> dict[str, object]:
    """The row's dataset columns, by name ({} for a row that has none, such as a game's)."""
    if isinstance(row, Mapping):
        return {str(k): v for k, v in row.items()}
    if isinstance(row, HasColumns):
        return dict(row.columns)
    return {}


def is_text(row: object) -> bool:
    """TRL's rule: text completions when the dataset's prompt is text (module docstring)."""
    return isinstance(row, PromptRow) and row.text_prompt


def split_messages(t: Trajectory) -> tuple[list[ChatMessage], list[ChatMessage]]:
    """(prompt, completion) messages of the seat's transcript, split at its first assistant message."""
    messages = [{"role": m.get("role"), "content": m.get("content")} for m in t.infos.messages]
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    completion = messages[first:] or [{"role": "assistant", "content": t.infos.completion}]
    return messages[:first], completion


def prompt_text(prompt: list[ChatMessage]) -> str:
    users = [m for m in prompt if m["role"] == "user"]
    return str(users[-1]["content"]) if users else ""


def completion_ids(t: Trajectory) -> list[int]:
    """The ids the seat sampled in its last trained turn ([] when it has none)."""
    mine = [s for s in t.turns if s.speaker == t.participant] or list(t.turns)
    if not mine:
        return []
    s = mine[-1]
    ids, mask = t.token_ids[s.start : s.end], t.loss_mask[s.start : s.end]
    return [i for i, m in zip(ids, mask) if m]


def batch_columns(rows: Sequence[object]) -> dict[str, list[object]]:
    """Each column as a list over the batch (None where a row lacks it), the reserved names left out."""
    per_row = [columns_of(r) for r in rows]
    keys = [k for k in dict.fromkeys(k for c in per_row for k in c) if k not in RESERVED]
    return {k: [c.get(k) for c in per_row] for k in keys}
