"""What every reward function reads of a sample, built in one place: `reward_inputs(t, row)`.

Each convention (ours reading `t.infos`, TRL's `fn(prompts, completions, **kwargs)`, an ms-swift
ORM's `messages`, `--reward-model`, the judge's `{prompt}`) takes its arguments from the same
`RewardInputs`, on every source (lineups, `--dataset`, task families, schedulers, `--agent`,
verifiers), so what they see cannot drift apart:

- `transcript`: the whole conversation as the seat saw it (`infos.messages`), as
  `{"role", "content"}` messages: the row's opening messages, then everything said after;
- `prompt`: the opening messages (`infos.opening` of them; where a path leaves it unset, those
  before the seat's first message); `completion`: the rest, from the seat's first message on;
- `prompt_text`: the prompt as text: the last user message of the prompt (a text dataset's
  prompt cell); `completion_text`: the seat's last message (`infos.completion`);
  `context_text`: the transcript's contents before the seat's last message, a line apart;
- `columns`: every dataset column of the row (a `--dataset` row's `columns`, a reasoning-gym
  entry's `question` / `answer` / `metadata`, an ms-swift row's own keys);
- `completion_ids`: the token ids the seat sampled in its last turn.

Text or conversational (TRL's rule, made ours): text when the row is a `--dataset` row whose
prompt cell is a string (TRL: the dataset's prompt is text), conversational otherwise (message
lists in the dataset, and every multi-turn, game, reasoning-gym or scheduler task: they are
chats). Trainer state and environments are not per sample: the conventions pass them beside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RewardInputs:
    """One sample as reward functions read it (module docstring)."""

    prompt: list[ChatMessage]  # the row's opening messages
    completion: list[ChatMessage]  # from the seat's first message to the end
    prompt_text: str  # the prompt's last user message
    completion_text: str  # the seat's last message
    columns: dict[str, object]  # the row's dataset columns
    completion_ids: list[int]  # sampled in the seat's last turn
    text: bool  # TRL's rule: the dataset's prompt is text

    @property
    def transcript(self) -> list[ChatMessage]:
        """The whole conversation: the prompt, then the completion."""
        return [*self.prompt, *self.completion]

    @property
    def context_text(self) -> str:
        """The contents of the transcript before the seat's last message, a line apart: what the
        seat had read when it gave its completion (in a game an environment's reply may follow
        it, and is not part of this). The judge's `{prompt}` and a reward model's plain text."""
        messages = self.transcript
        seat = {"role": "assistant", "content": self.completion_text}
        last = [i for i, m in enumerate(messages) if m == seat]
        return "\n".join(str(m["content"]) for m in (messages[: last[-1]] if last else messages))


def reward_inputs(t: Trajectory, row: object) -> RewardInputs:
    """What reward functions read of trajectory `t`, which came from `row`."""
    messages: list[ChatMessage] = [
        {"role": str(m.get("role", "user")), "content": str(m.get("content") or "")} for m in t.infos.messages
    ]
    opening = t.infos.opening
    if opening is None:
        opening = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    prompt, completion = messages[:opening], messages[opening:]
    if not completion:  # a sample that said nothing (a failed first turn): its empty reply
        completion = [{"role": "assistant", "content": t.infos.completion}]
    users = [m for m in prompt if m["role"] == "user"]
    return RewardInputs(
        prompt=prompt,
        completion=completion,
        prompt_text=str(users[-1]["content"]) if users else "",
        completion_text=t.infos.completion,
        columns=columns_of(row),
        completion_ids=completion_ids(t),
        text=is_text(row),
    )


def columns_of(row: object) -> dict[str, object]:
    """The row's dataset columns, by name: a mapping's items, a row's `columns`, a dataclass's
    fields; {} for a row that has none (a game's)."""
    if isinstance(row, Mapping):
        return {str(k): v for k, v in row.items()}
    if isinstance(row, HasColumns):
        return dict(row.columns)
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}
    return {}


def is_text(row: object) -> bool:
    """TRL's rule: text completions when the dataset's prompt is text (module docstring)."""
    return isinstance(row, PromptRow) and row.text_prompt


def completion_ids(t: Trajectory) -> list[int]:
    """The ids the seat sampled in its last trained turn ([] when it has none)."""
    mine = [s for s in t.turns if s.speaker == t.participant] or list(t.turns)
    if not mine:
        return []
    s = mine[-1]
    ids, mask = t.token_ids[s.start : s.end], t.loss_mask[s.start : s.end]
    return [i for i, m in zip(ids, mask) if m]


def batch_columns(inputs: Sequence[RewardInputs]) -> dict[str, list[object]]:
    """Each column as a list over the batch (None where a row lacks it), the reserved names left out."""
    keys = [k for k in dict.fromkeys(k for x in inputs for k in x.columns) if k not in RESERVED]
    return {k: [x.columns.get(k) for x in inputs] for k in keys}
