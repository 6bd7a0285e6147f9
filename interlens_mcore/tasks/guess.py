"""Guess-a-number: the policy guesses, the environment answers "higher", "lower" or "correct".

The default game is small enough for a tiny model to learn: a secret in [1, 7] and 3 guesses,
exactly what binary search needs to solve every game (guess 4, then 2 or 6, then the last one
left). With `hints` (the default) an answer also says where the secret still lies ("higher:
between 5 and 7"), so the next move depends on the last answer alone and a 2-layer model can
learn it. The reward lies in [0, 1] and pays for solving, never for the look of a reply:

- solved at guess g of K: 1 - speed_weight * (g - 1) / K, so a faster solve scores more and
  the slowest solve still scores at least 1 - speed_weight;
- not solved: progress_weight x the share of the secret's uncertainty the valid guesses
  removed, log(N / |C|) / log(N), where N numbers were possible at the start and C is the set
  still consistent with every "higher" / "lower" answer. A guess outside the range, a reply
  without a number, or a guess already ruled out narrows nothing and earns nothing.

Since speed_weight + progress_weight < 1, every solved game outscores every unsolved one, and
among unsolved games only information about the secret pays: repeating a fixed answer, or
filling replies with digits, earns what its first guess revealed and no more. A reply's guess
is its first integer. `conv.infos["success"]` is 1.0 once the game is solved, else 0.0.

Example::

    task = GuessNumberTask(secret=5)
    conv = Conversation(task.lineup(seat), prompt=task.prompt(), run_until=MaxTurns(task.max_turns))
    co_step([conv]); reward = conv.lineup[1].reward(conv); solved = conv.infos["success"]
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..rollout.conversation import Conversation, Environment, Participant, Policy
from ..rollout.costep import co_step
from ..rollout.stop import MaxTurns
from ..types import Message

_NUMBER = re.compile(r"-?\d+")


def reply_number(text: str) -> int | None:
    """The first integer in a reply, or None."""
    m = _NUMBER.search(text)
    return int(m.group()) if m else None


@dataclass(frozen=True, kw_only=True)
class GuessNumberTask:
    """One game: the secret, the range it was drawn from, the guesses allowed, the reward's weights."""

    secret: int
    low: int = 1
    high: int = 7
    max_guesses: int = 3
    speed_weight: float = 0.3  # what solving at the last guess costs against solving at the first
    progress_weight: float = 0.3  # the most an unsolved game earns (secret pinned down, not said)
    hints: bool = True  # answers say where the secret still lies ("higher: between 5 and 7")

    def __post_init__(self) -> None:
        if self.low >= self.high:
            raise ValueError(f"GuessNumberTask range [{self.low}, {self.high}] must hold two numbers or more")
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"GuessNumberTask.secret {self.secret} lies outside [{self.low}, {self.high}]")
        if self.max_guesses < 1:
            raise ValueError(f"GuessNumberTask.max_guesses must be >= 1, got {self.max_guesses}")
        for name in ("speed_weight", "progress_weight"):
            if getattr(self, name) < 0.0:
                raise ValueError(f"GuessNumberTask.{name} must be >= 0, got {getattr(self, name)}")
        if self.speed_weight + self.progress_weight >= 1.0:
            raise ValueError(
                f"GuessNumberTask.speed_weight + progress_weight must be < 1 (so every solved game "
                f"outscores every unsolved one), got {self.speed_weight} + {self.progress_weight}"
            )

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
    low, high = task_kwargs.get("low", 1), task_kwargs.get("high", 7)
    return [GuessNumberTask(secret=rng.randint(low, high), **task_kwargs) for _ in range(n)]


@dataclass(frozen=True)
class GameState:
    """What a sequence of guesses established about the secret."""

    solved_at: int | None  # 1-based index of the guess that named the secret, or None
    low: int  # the secret lies in [low, high] given every answer so far
    high: int


def game_state(task: GuessNumberTask, guesses: list[int | None]) -> GameState:
    """Replay `guesses` (None: a reply without a number) against the game's answers."""
    low, high = task.low, task.high
    for i, g in enumerate(guesses, start=1):
        if g == task.secret:
            return GameState(solved_at=i, low=g, high=g)
        if g is None or not low <= g <= high:
            continue  # out of range, or already ruled out: the answer tells nothing new
        if g < task.secret:
            low = g + 1
        else:
            high = g - 1
    return GameState(solved_at=None, low=low, high=high)


def game_reward(task: GuessNumberTask, state: GameState) -> float:
    """The reward of a finished game (see the module docstring)."""
    if state.solved_at is not None:
        return 1.0 - task.speed_weight * (state.solved_at - 1) / task.max_guesses
    size, left = task.high - task.low + 1, state.high - state.low + 1
    return task.progress_weight * math.log(size / left) / math.log(size)


class GuessNumber(Environment):
    """The game master of one conversation; it answers after every policy turn."""

    role = "user"

    def __init__(self, task: GuessNumberTask, *, name: str = "game", policy: str = "policy"):
        self.task, self.name, self.policy = task, name, policy

    def _guesses(self, conv: Conversation) -> list[int | None]:
        return [reply_number(m.content) for m in conv.messages if m.speaker == self.policy]

    def respond(self, conv: Conversation) -> str:
        guesses = self._guesses(conv)
        guess = guesses[-1] if guesses else None
        t = self.task
        if guess == t.secret:
            conv.infos["success"] = 1.0
            conv.request_stop("solved")
            return "correct"
        conv.infos["success"] = 0.0
        if len(guesses) >= t.max_guesses:
            conv.request_stop("out of guesses")
        if guess is None or not t.low <= guess <= t.high:
            return f"answer with a number between {t.low} and {t.high}"
        if not t.hints:
            return "higher" if guess < t.secret else "lower"
        state = game_state(t, guesses)
        return f"{'higher' if guess < t.secret else 'lower'}: between {state.low} and {state.high}"

    def reward(self, conv: Conversation) -> float:
        return game_reward(self.task, game_state(self.task, self._guesses(conv)))


class Guesser(Environment):
    """Plays the policy's seat of guess-a-number from a script: the binary-search move with
    probability `binary_share`, else a uniformly random number of the range (answers ignored)."""

    name, role = "policy", "assistant"

    def __init__(self, task: GuessNumberTask, binary_share: float, *, seed: int):
        self.task, self.binary_share, self.rng = task, binary_share, random.Random(seed)

    def respond(self, conv: Conversation) -> str:
        t = self.task
        if self.rng.random() >= self.binary_share:
            return str(self.rng.randint(t.low, t.high))
        state = game_state(t, [reply_number(m.content) for m in conv.messages if m.speaker == self.name])
        return str((state.low + state.high) // 2)


def guess_transcripts(n: int, *, seed: int, binary_share: float, **task_args: object) -> list[list[Message]]:
    """`n` games of guess-a-number played by a `Guesser`, as message lists (prompt included)."""
    convs = []
    for i, task in enumerate(guess_tasks(n, seed=seed, **task_args)):
        guesser = Guesser(task, binary_share, seed=seed * 1_000_003 + i)
        lineup: list[Participant] = [guesser, task.environment()]
        convs.append(Conversation(lineup, prompt=task.prompt(), run_until=MaxTurns(task.max_turns)))
    co_step(convs, turns=None)
    return [[*c.prompt, *c.messages] for c in convs]
