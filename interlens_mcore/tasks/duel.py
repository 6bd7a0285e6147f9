"""Number duel: two players name a number; the one closer to the referee's target wins.

Seats `player_a` and `player_b` speak in that order, then the referee judges and ends the
game. B's view holds A's number (as a user turn) before B answers; A answers blind. Rewards
per seat lie in [0, 1]:

- form (weight `form_weight`): 1 when the reply names a number in [low, high] (its first
  integer), else 0, so a tiny model that has not learnt the game yet is paid for playing it;
  digit strings or repeated numbers earn what their first number earns, never more;
- game (the rest): `closeness_weight` x closeness (1 - |number - target| / (high - low)) plus
  the rest x outcome: 1 for the winner, 1/2 each on a tie, 0 for the loser. A reply without a
  number has closeness 0 and loses to one with a number; when neither holds a number nobody
  played and both get outcome 0.

Form, closeness and the "nobody played" case are not zero-sum: in self-play both seats'
rewards rise while they learn to play, and closeness keeps pulling toward the target when
every game is a tie. Between two players who play, the outcome is zero-sum, so skill at the
game itself is measured against a fixed opponent: a uniformly random player
(`DuelTask(random_seats=...)`), or the frozen initial weights (`DuelTask(frozen_seats=...)`,
which the trainer fills). The win rate counts a tie as half a win. A game with one such
opponent reports the other seat's outcome as `conv.infos["rate/win_vs_random"]` or
`["rate/win_vs_initial"]`, and per seat as `.../<seat>` (evaluation's `eval/rate/...`).

Example (self-play: the trainer fills both seats with the trained policy)::

    task = DuelTask(target=7)
    conv = Conversation(task.lineup(seat), prompt=task.prompt(), run_until=MaxTurns(task.max_turns))
    co_step([conv]); a, b = conv.trajectories()   # one per seat, each from its own view
    reward_a = conv.lineup[-1].reward_for(conv, "player_a")   # the referee speaks last
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from ..rollout.conversation import Conversation, Environment, Participant, Policy
from ..types import Message
from .guess import reply_number

SEATS = ("player_a", "player_b")


def _plays(number: int | None, low: int, high: int) -> float:
    """1.0 when a reply's number is a move of the game (in range), else 0.0."""
    return float(number is not None and low <= number <= high)


@dataclass(frozen=True, kw_only=True)
class DuelTask:
    """One game: the target, the range, and which seats a random player takes."""

    target: int
    low: int = 1
    high: int = 9
    form_weight: float = 0.5
    closeness_weight: float = 0.5  # share of the game part paid for closeness to the target
    random_seats: tuple[str, ...] = ()  # seats played by a uniformly random player, not a policy
    frozen_seats: tuple[str, ...] = ()  # seats played by the trainer's frozen initial weights
    max_turns: ClassVar[int] = 3  # player_a, player_b, referee

    def __post_init__(self) -> None:
        if not self.low <= self.target <= self.high:
            raise ValueError(f"DuelTask.target {self.target} lies outside [{self.low}, {self.high}]")
        for name in ("form_weight", "closeness_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"DuelTask.{name} must lie in [0, 1], got {getattr(self, name)}")
        for name in ("random_seats", "frozen_seats"):
            unknown = [s for s in getattr(self, name) if s not in SEATS]
            if unknown:
                raise ValueError(f"DuelTask.{name} holds {unknown}; the seats are {list(SEATS)}")
        both = set(self.random_seats) & set(self.frozen_seats)
        if both:
            raise ValueError(f"DuelTask: seats {sorted(both)} are in both random_seats and frozen_seats")

    def prompt(self) -> list[Message]:
        text = f"target {self.target}. say a number from {self.low} to {self.high}. closest wins"
        return [Message(speaker="referee", content=text, role="user")]

    def environment(self) -> DuelReferee:
        return DuelReferee(self)

    def lineup(self, seat: Callable[[str], Policy]) -> list[Participant]:
        """Both seats in order (a policy from `seat(name)`, a random player, or the frozen initial
        weights from `seat.frozen(name)`), then the referee."""
        players: list[Participant] = []
        for name in SEATS:
            if name in self.random_seats:
                players.append(RandomPlayer(name, self.low, self.high))
            elif name in self.frozen_seats:
                frozen = getattr(seat, "frozen", None)
                if frozen is None:
                    raise ValueError(
                        f"DuelTask.frozen_seats {list(self.frozen_seats)}: the seat callable has no "
                        ".frozen(name); the trainer's (a rollout.Seats) gives the frozen initial weights"
                    )
                players.append(frozen(name))
            else:
                players.append(seat(name))
        return [*players, self.environment()]

    def opponent(self) -> tuple[str, str] | None:
        """(the fixed opponent's kind, "random" or "initial"; the seat it plays against), when one
        seat is a fixed opponent and the other is not."""
        fixed = [*self.random_seats, *self.frozen_seats]
        if len(fixed) != 1:
            return None
        (other,) = (s for s in SEATS if s not in fixed)
        return ("random" if fixed[0] in self.random_seats else "initial", other)


def duel_tasks(n: int, *, seed: int, **task_kwargs) -> list[DuelTask]:
    """`n` games with targets drawn from `seed` alone (the same on every rank and every resume)."""
    rng = random.Random(seed)
    low, high = task_kwargs.get("low", 1), task_kwargs.get("high", 9)
    return [DuelTask(target=rng.randint(low, high), **task_kwargs) for _ in range(n)]


class RandomPlayer(Environment):
    """A fixed opponent: names a uniformly random number, seeded by the conversation."""

    role = "user"

    def __init__(self, name: str, low: int, high: int):
        self.name, self.low, self.high = name, low, high

    def respond(self, conv: Conversation) -> str:
        rng = random.Random(zlib.crc32(f"{conv.seed}/{self.name}".encode()))
        return str(rng.randint(self.low, self.high))


class DuelReferee(Environment):
    """Judges after both players spoke; writes `conv.infos['outcome']` (seat -> 1, 1/2 or 0)."""

    name, role = "referee", "user"

    def __init__(self, task: DuelTask):
        self.task = task

    def _reply(self, conv: Conversation, seat: str) -> str | None:
        said = [m.content for m in conv.messages if m.speaker == seat]
        return said[-1] if said else None

    def respond(self, conv: Conversation) -> str:
        t = self.task.target
        dist = {}
        for seat in SEATS:
            n = reply_number(self._reply(conv, seat) or "")
            dist[seat] = abs(n - t) if n is not None else None
        a, b = (dist[s] for s in SEATS)
        if a is None and b is None:
            outcome = dict.fromkeys(SEATS, 0.0)  # nobody played
        elif b is None or (a is not None and a < b):
            outcome = {"player_a": 1.0, "player_b": 0.0}
        elif a is None or b < a:
            outcome = {"player_a": 0.0, "player_b": 1.0}
        else:
            outcome = dict.fromkeys(SEATS, 0.5)
        conv.infos["outcome"] = outcome
        fixed = self.task.opponent()
        if fixed is not None:
            kind, seat = fixed
            conv.infos[f"rate/win_vs_{kind}"] = conv.infos[f"rate/win_vs_{kind}/{seat}"] = outcome[seat]
        conv.request_stop("judged")
        winners = [s for s in SEATS if outcome[s] == 1.0]
        return f"{winners[0]} wins" if winners else "tie" if outcome["player_a"] else "nobody played"

    def reward_for(self, conv: Conversation, participant: str) -> float | None:
        outcome = conv.infos.get("outcome")
        reply = self._reply(conv, participant)
        if outcome is None or participant not in outcome or reply is None:
            return None  # not a seat of this game, or the game never reached the referee
        t = self.task
        n = reply_number(reply)
        close = 0.0 if n is None else max(0.0, 1.0 - abs(n - t.target) / (t.high - t.low))
        game = (1.0 - t.closeness_weight) * outcome[participant] + t.closeness_weight * close
        return t.form_weight * _plays(n, t.low, t.high) + (1.0 - t.form_weight) * game
