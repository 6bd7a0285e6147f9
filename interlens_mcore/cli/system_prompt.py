"""`--system-prompt TEXT`: any task source, with a system message first in every conversation.

Lineup rows (the toy games, task families, `--dataset` prompts) gain it in `prompt()`; rows of a
scheduler source (message lists, or dicts holding `messages`, as ms-swift's) gain it in their
messages. A row that already opens with a system message keeps it, after ours (one system
message: chat templates render only the first as the system turn). `--tools` wraps the result,
so the tool descriptions join the same system message.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from interlens_mcore.rollout.conversation import Participant, Policy
from interlens_mcore.rollout.rollouter import Rollout, Rollouter
from interlens_mcore.tasks.base import Task, TaskSource
from interlens_mcore.types import Message, Trajectory


def _joined(text: str, existing: str | None) -> str:
    return text if not existing else f"{text}\n\n{existing}"


@dataclass(eq=False)
class SystemPromptTask:
    """A lineup row whose opening transcript starts with the system prompt."""

    inner: Task
    text: str

    @property
    def max_turns(self) -> int:
        return self.inner.max_turns

    def prompt(self) -> list[Message]:
        messages = list(self.inner.prompt())
        if messages and messages[0].role == "system":
            first = messages.pop(0)
            return [Message(speaker=first.speaker, content=_joined(self.text, first.content), role="system"),
                    *messages]  # fmt: skip
        return [Message(speaker="system", content=self.text, role="system"), *messages]

    def lineup(self, seat: Callable[[str], Policy]) -> list[Participant]:
        return self.inner.lineup(seat)

    def __getattr__(self, name: str) -> Any:
        # the row's own fields (`columns`, a reasoning-gym `entry`) stay readable by reward functions
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def with_system_messages(row: object, text: str, where: str) -> object:
    """A scheduler row (a message list, or a dict holding `messages`) with the system prompt first."""
    row = copy.deepcopy(row)
    messages = row.get("messages") if isinstance(row, dict) else row
    if not isinstance(messages, list):
        raise ValueError(
            f"--system-prompt: a row of {where} is {type(row).__name__}, expected a message list "
            "or a dict holding 'messages'"
        )
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        messages[0]["content"] = _joined(text, messages[0].get("content"))
    else:
        messages.insert(0, {"role": "system", "content": text})
    return row


class SystemPromptSource(TaskSource):
    """`source`'s rows with `text` as their system message; everything else is `source`'s."""

    def __init__(self, source: TaskSource, text: str):
        if not text.strip():
            raise ValueError("--system-prompt is empty")
        self.source, self.text = source, text
        self.name, self.reward_key, self.stop = source.name, source.reward_key, source.stop
        self.trained_seats, self.frozen_seats = source.trained_seats, source.frozen_seats
        self.eval_frozen_seats = source.eval_frozen_seats

    def _wrap(self, rows: Sequence[object]) -> list[object]:
        if self.source.scheduler() is not None:
            return [with_system_messages(r, self.text, self.source.name) for r in rows]
        return [SystemPromptTask(inner=cast(Task, r), text=self.text) for r in rows]  # lineup rows

    def rows(self, n: int, *, seed: int) -> list[object]:
        return self._wrap(self.source.rows(n, seed=seed))

    def eval_rows(self, n: int, *, seed: int) -> list[object]:
        return self._wrap(self.source.eval_rows(n, seed=seed))

    def demonstrations(self, n: int, *, seed: int) -> list[list[dict[str, str]]]:
        """The source's demonstrations opening with the system prompt, as its rows do."""
        return [
            cast(list[dict[str, str]], with_system_messages(d, self.text, self.source.name))
            for d in self.source.demonstrations(n, seed=seed)
        ]

    def scheduler(self) -> object | None:
        return self.source.scheduler()

    def run(self, rollouter: Rollouter, rows: Sequence[object], step: int) -> Rollout:
        return self.source.run(rollouter, rows, step)

    def evaluate(self, rollouter: Rollouter, rows: Sequence[object], step: int) -> Rollout:
        return self.source.evaluate(rollouter, rows, step)

    def success_of(self, trajectory: Trajectory) -> float | None:
        return self.source.success_of(trajectory)

    def option_defaults(self) -> dict[str, object]:
        return self.source.option_defaults()

    def dataset_of(self, row: object) -> str | None:
        return self.source.dataset_of(row.inner if isinstance(row, SystemPromptTask) else row)

    def describe(self) -> dict[str, Any]:
        return {**self.source.describe(), "system_prompt": self.text}
