"""Guess-a-number's reward ranks playing the game above every way of gaming it.

Scripted players sit in the policy's seat and play through `co_step`; each strategy's score is
its mean reward over every secret of the range (and, for the random guesser, many seeds).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import pytest

from interlens_mcore.rollout.conversation import Conversation, Environment
from interlens_mcore.rollout.costep import co_step
from interlens_mcore.rollout.stop import MaxTurns
from interlens_mcore.tasks.guess import (
    GuessNumber,
    GuessNumberTask,
    game_reward,
    game_state,
    guess_tasks,
    reply_number,
)

Strategy = Callable[[GuessNumberTask, list[tuple[int | None, str]], random.Random], str]


class Player(Environment):
    """Plays the policy's seat with a strategy of (task, [(own guess, answer)], rng) -> reply."""

    name, role = "policy", "assistant"

    def __init__(self, task: GuessNumberTask, strategy: Strategy, seed: int):
        self.task, self.strategy, self.rng = task, strategy, random.Random(seed)

    def respond(self, conv: Conversation) -> str:
        said = [m.content for m in conv.messages if m.speaker == "policy"]
        answers = [m.content for m in conv.messages if m.speaker == "game"]
        history = [(reply_number(s), a) for s, a in zip(said, answers)]
        return self.strategy(self.task, history, self.rng)


def fixed(value: str) -> Strategy:
    return lambda task, history, rng: value


def random_guesser(task, history, rng) -> str:
    return str(rng.randint(task.low, task.high))


def binary_search(task, history, rng) -> str:
    low, high = task.low, task.high
    for guess, answer in history:
        low, high = (guess + 1, high) if answer.startswith("higher") else (low, guess - 1)
    return str((low + high) // 2)


def perfect(task, history, rng) -> str:
    return str(task.secret)


def play(strategy: Strategy, *, seeds: int = 1, **task_kwargs) -> tuple[float, float]:
    """(mean reward, success rate) over every secret of the range x `seeds` games each."""
    convs = []
    for secret in range(task_kwargs.get("low", 1), task_kwargs.get("high", 7) + 1):
        task = GuessNumberTask(secret=secret, **task_kwargs)
        for seed in range(seeds):
            lineup = [Player(task, strategy, seed), task.environment()]
            convs.append(Conversation(lineup, prompt=task.prompt(), run_until=MaxTurns(task.max_turns)))
    co_step(convs, turns=None)
    rewards = [c.lineup[1].reward(c) for c in convs]
    successes = [c.infos["success"] for c in convs]
    return sum(rewards) / len(rewards), sum(successes) / len(successes)


GAMING = {
    "digit string out of range": fixed(" 51 18 85 21 51 85"),
    "digit string in range": fixed("4 2 6 1 3 5 7"),
    "digits and words": fixed("7777 the number 7777"),
    "no number": fixed("higher"),
    **{f"always {v}": fixed(str(v)) for v in range(1, 8)},
}


def test_playing_outscores_gaming_and_guessing():
    binary, binary_success = play(binary_search)
    best, best_success = play(perfect)
    guessing, guessing_success = play(random_guesser, seeds=40)
    assert binary_success == 1.0 and best_success == 1.0
    # binary search solves 4 at guess 1, 2 and 6 at guess 2, the other four at guess 3:
    # (1 + 2 x 0.9 + 4 x 0.8) / 7 = 6 / 7
    assert binary == pytest.approx(6 / 7)
    assert best == 1.0
    for name, strategy in GAMING.items():
        score, success = play(strategy)
        assert score < guessing < binary < best, name
        assert success <= 1 / 7, name
    # three independent uniform guesses solve 1 - (6/7)^3 = 0.37 of the games
    assert abs(guessing_success - (1 - (6 / 7) ** 3)) < 0.08


def test_best_fixed_answer_is_the_middle_and_scores_little():
    # "always 4": solves 1 in 7; otherwise its first answer leaves 3 of 7 numbers:
    # 0.3 x log(7/3) / log(7) = 0.1306 -> (1 + 6 x 0.1306) / 7 = 0.2548
    scores = {v: play(fixed(str(v)))[0] for v in range(1, 8)}
    assert max(scores, key=scores.get) == 4
    assert scores[4] == pytest.approx((1 + 6 * 0.3 * math.log(7 / 3) / math.log(7)) / 7)


def test_every_solved_game_outscores_every_unsolved_one():
    # every sequence of 3 replies (a number in or out of range, or none) against every secret
    solved, unsolved = [], []
    for task in [GuessNumberTask(secret=s) for s in range(1, 8)]:
        for guesses in itertools.product([None, 0, *range(1, 9)], repeat=3):
            state = game_state(task, list(guesses))
            (solved if state.solved_at else unsolved).append(game_reward(task, state))
    assert min(solved) == pytest.approx(0.8) and max(solved) == 1.0
    assert min(unsolved) == 0.0 and max(unsolved) == pytest.approx(0.3)
    assert max(unsolved) < min(solved)


def test_answers_and_success_infos():
    task = GuessNumberTask(secret=5)
    replies = ["my guess: 9", "0", "4", "5"]
    lineup = [Player(task, lambda t, h, r: replies[len(h)], 0), task.environment()]
    conv = Conversation(lineup, prompt=task.prompt(), run_until=MaxTurns(task.max_turns))
    co_step([conv], turns=None)
    answers = [m.content for m in conv.messages if m.speaker == "game"]
    # 9 and 0 lie outside [1, 7]; 4 is too low; the third guess ends the game unsolved
    assert answers == ["answer with a number between 1 and 7"] * 2 + ["higher: between 5 and 7"]
    assert conv.infos["success"] == 0.0
    # only "4" narrowed the secret, to [5, 7]: 0.3 x log(7/3) / log(7)
    assert conv.lineup[1].reward(conv) == pytest.approx(0.3 * math.log(7 / 3) / math.log(7))


def test_hints_say_where_the_secret_lies():
    def answers(task, replies):
        lineup = [Player(task, lambda t, h, r: replies[len(h)], 0), task.environment()]
        conv = Conversation(lineup, prompt=task.prompt(), run_until=MaxTurns(task.max_turns))
        co_step([conv], turns=None)
        return [m.content for m in conv.messages if m.speaker == "game"]

    # 2 -> [3, 7]; 6 -> [3, 5]; 7 was ruled out already, so the interval stays [3, 5]
    assert answers(GuessNumberTask(secret=3), ["2", "6", "7"]) == [
        "higher: between 3 and 7",
        "lower: between 3 and 5",
        "lower: between 3 and 5",
    ]
    assert answers(GuessNumberTask(secret=3, hints=False), ["2", "6", "3"]) == ["higher", "lower", "correct"]
    # without hints the ranking holds too
    assert play(binary_search, hints=False) == play(binary_search)


def test_a_wasted_guess_earns_nothing():
    task = GuessNumberTask(secret=6)
    # 4 -> higher leaves [5, 7]; 2 was already ruled out and so tells nothing new
    once = game_reward(task, game_state(task, [4]))
    assert game_reward(task, game_state(task, [4, 2, 4])) == once
    assert game_reward(task, game_state(task, [4, 5])) > once  # 5 -> higher leaves [6, 7]
    assert game_reward(task, game_state(task, [4, 5, 6])) == pytest.approx(1 - 0.3 * 2 / 3)


def test_bigger_games_keep_the_order():
    # 1..15 with 4 guesses: binary search still solves every game and leads every fixed answer
    binary, success = play(binary_search, high=15, max_guesses=4)
    assert success == 1.0
    assert max(play(fixed(str(v)), high=15, max_guesses=4)[0] for v in range(1, 16)) < binary


def test_task_checks_its_fields():
    with pytest.raises(ValueError, match="secret 9 lies outside"):
        GuessNumberTask(secret=9)
    with pytest.raises(ValueError, match="must be < 1"):
        GuessNumberTask(secret=1, speed_weight=0.5, progress_weight=0.5)
    with pytest.raises(ValueError, match="max_guesses"):
        GuessNumberTask(secret=1, max_guesses=0)
    assert isinstance(guess_tasks(2, seed=0)[0].environment(), GuessNumber)
    assert {t.secret for t in guess_tasks(200, seed=0)} == set(range(1, 8))
