"""Toy multi-turn environments shipped with the package, small enough for a random tiny model.

Their task sources (`interlens_mcore.tasks.GuessTasks`, `DuelTasks`) are what `--task guess`
and `--task duel` select.
"""

from __future__ import annotations

from .duel import SEATS, DuelReferee, DuelTask, RandomPlayer, duel_tasks
from .guess import GuessNumber, GuessNumberTask, guess_tasks, reply_number

__all__ = [
    "SEATS",
    "DuelReferee",
    "DuelTask",
    "GuessNumber",
    "GuessNumberTask",
    "RandomPlayer",
    "duel_tasks",
    "guess_tasks",
    "reply_number",
]
