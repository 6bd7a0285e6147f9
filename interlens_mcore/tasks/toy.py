"""Task sources of the toy games shipped with the package (`guess`, `duel`)."""

from __future__ import annotations

from typing import Literal

from .base import TaskSource
from .duel import SEATS, duel_tasks
from .guess import guess_tasks

_EVAL_SEED = 0x5EED_E7A1  # evaluation rows come from a seed no training step uses


class GuessTasks(TaskSource):
    """Guess-a-number, one policy seat; `task_args` go to `GuessNumberTask` (e.g. max_guesses)."""

    name = "guess"

    def __init__(self, **task_args: object):
        guess_tasks(1, seed=0, **task_args)  # a bad argument fails here, naming the field
        self.task_args = task_args

    def rows(self, n: int, *, seed: int) -> list:
        return guess_tasks(n, seed=seed, **self.task_args)

    def eval_rows(self, n: int, *, seed: int) -> list:
        return guess_tasks(n, seed=seed ^ _EVAL_SEED, **self.task_args)

    def describe(self) -> dict[str, object]:
        return {"name": self.name, **self.task_args}


OPPONENTS = ("self", "random", "frozen")


class DuelTasks(TaskSource):
    """The number duel: self-play (both seats trained), or player_b random or frozen.

    Evaluation plays the trained policy in each seat against a uniformly random player.
    """

    name = "duel"

    def __init__(self, opponent: Literal["self", "random", "frozen"] = "self", **task_args: object):
        if opponent not in OPPONENTS:
            raise ValueError(f"task_args.opponent must be one of {', '.join(OPPONENTS)}, got {opponent!r}")
        duel_tasks(1, seed=0, **task_args)
        self.opponent, self.task_args = opponent, task_args
        self.trained_seats = SEATS if opponent == "self" else SEATS[:1]
        self.frozen_seats = SEATS[1:] if opponent == "frozen" else ()

    def rows(self, n: int, *, seed: int) -> list:
        random_seats = ("player_b",) if self.opponent == "random" else ()
        return duel_tasks(n, seed=seed, random_seats=random_seats, **self.task_args)

    def eval_rows(self, n: int, *, seed: int) -> list:
        return [
            task
            for i, seat in enumerate(SEATS)
            for task in duel_tasks(
                n,
                seed=(seed ^ _EVAL_SEED) + i,
                random_seats=tuple(s for s in SEATS if s != seat),
                **self.task_args,
            )
        ]

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "opponent": self.opponent, **self.task_args}
