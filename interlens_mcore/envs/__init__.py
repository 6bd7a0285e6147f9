"""Toy multi-turn environments shipped with the package, small enough for a random tiny model."""

from .guess import GuessNumber, GuessNumberTask, guess_tasks, reply_number

__all__ = ["GuessNumber", "GuessNumberTask", "guess_tasks", "reply_number"]
