"""Task sources of the toy games shipped with the package (`guess`, `duel`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from .base import TaskSource
from .duel import SEATS, duel_tasks
from .guess import guess_tasks, guess_transcripts

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

    def demonstrations(self, n: int, *, seed: int) -> list[list[dict[str, str]]]:
        """Games won by binary search (the `Guesser` always playing the halving move)."""
        games = guess_transcripts(n, seed=seed, binary_share=1.0, **self.task_args)
        return [[{"role": m.role, "content": m.content} for m in game] for game in games]

    def describe(self) -> dict[str, object]:
        return {"name": self.name, **self.task_args}


OPPONENTS = ("self", "random", "frozen")
EVAL_OPPONENTS = ("random", "initial")


class DuelTasks(TaskSource):
    """The number duel: self-play (both seats trained), or player_b random or frozen.

    Evaluation plays the trained policy in each seat against each of `eval_opponents`: a
    uniformly random player ("random", the default) and the frozen initial weights ("initial"),
    on the same targets. `eval/win_rate/<seat>` averages over all of them;
    `eval/rate/win_vs_<opponent>[/<seat>]` keeps them apart, each with its interval.
    """

    name = "duel"

    def __init__(
        self,
        opponent: Literal["self", "random", "frozen"] = "self",
        eval_opponents: Sequence[str] = ("random",),
        **task_args: object,
    ):
        if opponent not in OPPONENTS:
            raise ValueError(f"task_args.opponent must be one of {', '.join(OPPONENTS)}, got {opponent!r}")
        if isinstance(eval_opponents, str) or not eval_opponents:
            raise ValueError(f"task_args.eval_opponents must be a non-empty list, got {eval_opponents!r}")
        unknown = [o for o in eval_opponents if o not in EVAL_OPPONENTS]
        if unknown:
            raise ValueError(
                f"task_args.eval_opponents holds {unknown}; each must be one of {', '.join(EVAL_OPPONENTS)}"
            )
        duel_tasks(1, seed=0, **task_args)
        self.opponent, self.task_args = opponent, task_args
        self.eval_opponents = tuple(dict.fromkeys(eval_opponents))
        self.trained_seats = SEATS if opponent == "self" else SEATS[:1]
        self.frozen_seats = SEATS[1:] if opponent == "frozen" else ()
        self.eval_frozen_seats = SEATS if "initial" in self.eval_opponents else ()

    def rows(self, n: int, *, seed: int) -> list:
        random_seats = ("player_b",) if self.opponent == "random" else ()
        return duel_tasks(n, seed=seed, random_seats=random_seats, **self.task_args)

    def eval_rows(self, n: int, *, seed: int) -> list:
        """`n` games per seat per evaluation opponent; each opponent plays the same targets."""
        rows = []
        for kind in self.eval_opponents:
            for i, seat in enumerate(SEATS):
                others = tuple(s for s in SEATS if s != seat)
                fixed = {"random_seats": others} if kind == "random" else {"frozen_seats": others}
                rows += duel_tasks(n, seed=(seed ^ _EVAL_SEED) + i, **fixed, **self.task_args)
        return rows

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "opponent": self.opponent,
            "eval_opponents": list(self.eval_opponents),
            **self.task_args,
        }
