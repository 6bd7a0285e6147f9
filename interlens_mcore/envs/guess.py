"""Guess-a-number: the policy guesses, the environment answers "higher", "lower" or "correct".

The reward is shaped so that a randomly initialised tiny model has a gradient to follow from
its first step (rewards in [0, 1]):

- form (weight `form_weight`): per guess, the fraction of the reply's non-space characters
  that are digits, averaged over guesses. A random model scores about 0.2; a model that
  answers with bare numbers scores 1.
- closeness (the rest): 1 - |best guess - secret| / (quarter of the range), floored at 0, over
  the guesses that hold a number; 1 when solved, 0 when no guess held a number.

Example::

    task = GuessNumberTask(secret=42)
    conv = Conversation([policy, GuessNumber(task)], prompt=task.prompt(), run_until=MaxTurns(6))
    co_step([conv]); reward = conv.lineup[1].reward(conv)
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..conversation import Conversation, Environment, Participant, Policy
from ..trajectory import Message

_NUMBER = re.compile(r"-?\d+")


def reply_number(text: str) -> int | None:
    """The first integer in a reply, or None."""
    m = _NUMBER.search(text)
    return int(m.group()) if m else None


def _form(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


@dataclass(frozen=True, kw_only=True)
class GuessNumberTask:
    """One game: the secret and the range it was drawn from."""

    secret: int
    low: int = 1
    high: int = 100
    max_guesses: int = 3
    form_weight: float = 0.6

    def __post_init__(self) -> None:
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"GuessNumberTask.secret {self.secret} lies outside [{self.low}, {self.high}]")
        if self.max_guesses < 1:
            raise ValueError(f"GuessNumberTask.max_guesses must be >= 1, got {self.max_guesses}")
        if not 0.0 <= self.form_weight <= 1.0:
            raise ValueError(f"GuessNumberTask.form_weight must lie in [0, 1], got {self.form_weight}")

    def prompt(self) -> list[Message]:
        text = f"guess the number between {self.low} and {self.high}"
        return [Message(speaker="user", content=text, role="user")]

    def environment(self) -> GuessNumber:
        return GuessNumber(self)

    def lineup(self, seat: Callable[[str], Policy]) -> list[Participant]:
        """The policy guesses, the game master answers."""
        return [seat("policy"), self.environment()]

    @property
    def max_turns(self) -> int:
        """Conversation turns of a full game: a guess and a reply per guess."""
        return 2 * self.max_guesses


def guess_tasks(n: int, *, seed: int, **task_kwargs) -> list[GuessNumberTask]:
    """`n` games with secrets drawn from `seed` alone (the same on every rank and every resume)."""
    rng = random.Random(seed)
    low, high = task_kwargs.get("low", 1), task_kwargs.get("high", 100)
    return [GuessNumberTask(secret=rng.randint(low, high), **task_kwargs) for _ in range(n)]


class GuessNumber(Environment):
    """The game master of one conversation; it answers after every policy turn."""

    role = "user"

    def __init__(self, task: GuessNumberTask, *, name: str = "game", policy: str = "policy"):
        self.task, self.name, self.policy = task, name, policy

    def _guesses(self, conv: Conversation) -> list[str]:
        return [m.content for m in conv.messages if m.speaker == self.policy]

    def respond(self, conv: Conversation) -> str:
        guesses = self._guesses(conv)
        guess = reply_number(guesses[-1]) if guesses else None
        if guess == self.task.secret:
            conv.request_stop("solved")
            return "correct"
        if len(guesses) >= self.task.max_guesses:
            conv.request_stop("out of guesses")
        if guess is None:
            return "answer with a number"
        return "higher" if guess < self.task.secret else "lower"

    def reward(self, conv: Conversation) -> float:
        replies = self._guesses(conv)
        if not replies:
            return 0.0
        form = sum(_form(r) for r in replies) / len(replies)
        numbers = [n for n in (reply_number(r) for r in replies) if n is not None]
        t = self.task
        if t.secret in numbers:
            close = 1.0
        elif numbers:
            # a quarter of the range: a random guess earns little, a near miss most of it
            close = max(0.0, 1.0 - min(abs(n - t.secret) for n in numbers) / (0.25 * (t.high - t.low)))
        else:
            close = 0.0
        return t.form_weight * form + (1.0 - t.form_weight) * close
