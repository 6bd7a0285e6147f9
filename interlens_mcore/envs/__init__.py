"""Toy multi-turn environments shipped with the package, small enough for a random tiny model.

`make_tasks` is what the launch script's `--env` selects: a step's rows for one rank, drawn
from a seed alone (the same on every resume). `fixed_opponent_tasks` are evaluation games of a
multi-seat environment in which a random player takes every seat but one.
"""

from __future__ import annotations

from .duel import SEATS, DuelReferee, DuelTask, RandomPlayer, duel_tasks
from .guess import GuessNumber, GuessNumberTask, guess_tasks, reply_number

ENVS = ("guess", "duel")
# who fills player_b's seat of a multi-seat game in training: the trained policy, a random
# player, or a policy the trainer freezes (for the task, "frozen" is a policy seat like "self")
OPPONENTS = ("self", "random", "frozen")


def make_tasks(env: str, n: int, *, seed: int, opponent: str = "self", max_guesses: int = 3) -> list:
    """`n` training rows of `env`; `opponent="random"` puts a random player in player_b's seat.

    "self" and "frozen" both leave player_b a policy seat: the trainer decides who plays it.
    """
    if env == "guess":
        if opponent != "self":
            raise ValueError(f"opponent {opponent!r}: env 'guess' has a single seat")
        return guess_tasks(n, seed=seed, max_guesses=max_guesses)
    if env == "duel":
        if opponent not in OPPONENTS:
            raise ValueError(f"opponent must be one of {OPPONENTS}, got {opponent!r}")
        return duel_tasks(n, seed=seed, random_seats=("player_b",) if opponent == "random" else ())
    raise ValueError(f"env must be one of {ENVS}, got {env!r}")


def trained_seats(env: str, opponent: str = "self") -> int:
    """Trajectories one conversation of `env` trains: every policy seat in self-play, else one."""
    return len(SEATS) if env == "duel" and opponent == "self" else 1


def fixed_opponent_tasks(env: str, n: int, *, seed: int) -> list:
    """Per seat, `n` games of `env` against random players in the other seats ([] for one seat)."""
    if env != "duel":
        return []
    return [
        task
        for i, seat in enumerate(SEATS)
        for task in duel_tasks(n, seed=seed + i, random_seats=tuple(s for s in SEATS if s != seat))
    ]


__all__ = [
    "ENVS",
    "OPPONENTS",
    "SEATS",
    "DuelReferee",
    "DuelTask",
    "GuessNumber",
    "GuessNumberTask",
    "RandomPlayer",
    "duel_tasks",
    "fixed_opponent_tasks",
    "guess_tasks",
    "make_tasks",
    "reply_number",
    "trained_seats",
]
