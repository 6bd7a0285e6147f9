"""textarena two-player games as multi-seat lineups.

`source("TicTacToe-v0", opponent="self")`. A game's lineup is

    [arena_0, player_0, arena_1, player_1]

(the seat the game asks first speaks first; player_0 in every game allowed here). `arena_k`
applies the move the previous seat just made and shows seat `k` what the game tells
it (the rules on its first turn, then the game's messages since its last move); `player_k` is
the trainer's policy for that seat, or a random player. `opponent`:

- "self": both seats are the trained policy (self-play; each seat its own advantage group);
- "frozen": `player_1` is a policy the trainer freezes at the initial weights;
- "random": `player_1` plays a uniformly random bracketed move among those the game's last
  message lists (e.g. "[4]"), seeded by the conversation.

Seat rewards are the game's own (`env.close()`: 1 win, -1 loss, 0 draw, per player), given by
`arena_0.reward_for`; `conv.infos["outcome"]` holds 1 / 1/2 / 0 per seat for the win rate.
`eval_rows` plays the trained policy in each seat against the random player, as the duel's
evaluation does.

Every seat's view holds the whole transcript (both seats read each observation), and a
lineup's turns alternate; so games with private information or simultaneous moves, which
would leak one player's view to the other, are refused, as are games that need a network,
an API key, a data file the wheel lacks, or Python 3.12 (`REFUSED`). A move the game rejects
ends the game as a loss for the seat that made it (the game would ask the same seat again,
out of the lineup's turn); textarena itself does this once its error allowance is spent.
`conv.infos["invalid_moves"]` counts them. A game that asks a seat for a second valid move in
a row ends as a draw, `conv.infos["out_of_turn"] = 1` (none of the games allowed here did in
our trials; Othello's forced pass could).
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..rollout.conversation import Conversation, Environment, Participant, Policy
from ..types import Message
from .base import TaskSource
from .families import LONG_CONVERSATIONS
from .split import check_fraction, derive_seed, held_out

SEATS = ("player_0", "player_1")
Opponent = Literal["self", "random", "frozen"]

_PY312 = "its code uses f-strings that need Python 3.12"
_NLTK = "it downloads an NLTK word list when imported, which needs a network"
_API = "it asks a hosted model to judge, which needs a network and an API key"
_PRIVATE = (
    "it keeps information private to one player or has simultaneous moves, and both seats here "
    "read the whole transcript"
)
_PRIVATE_GAMES = (
    "Poker KuhnPoker IndianPoker LiarsDice Battleship Stratego Briscola GermanWhist Golf "
    "GuessWho Codenames SecretMafia SimpleNegotiation SimpleBlindAuction HighSociety Crusade "
    "SpiteAndMalice IteratedPrisonersDilemma IteratedRockPaperScissors "
    "IteratedMatchingPennies IteratedTwoThirdsAverage IteratedUltimatumGame ColonelBlotto "
    "GameOfPureStrategy Snake Surround MarketEntryGame PublicGoodsGame Taboo "
    "CharacterConclave ScorableGames MemoryGame Set NewRecruit TruthAndDeception TwoDollar"
).split()
REFUSED: dict[str, str] = {
    **dict.fromkeys(("Chess", "Checkers", "IteratedStagHunt", "ReverseTicTacToe"), _PY312),
    **dict.fromkeys(("DontSayIt", "LetterAuction", "SpellingBee", "WordChains"), _NLTK),
    **dict.fromkeys(("Debate", "ScenarioPlanning"), _API),
    "UsedCarNegotiation": "its data file is missing from the textarena 0.7.4 wheel",
    **dict.fromkeys(_PRIVATE_GAMES, _PRIVATE),
    "PigDice": "a player moves several times in a row, and a lineup's seats alternate",
}


def refusal(game_id: str) -> str | None:
    """Why `game_id` cannot be played here, or None."""
    return REFUSED.get(game_id.split("-v")[0])


def _raw(env: Any) -> Any:
    # ta.make wraps the game in observation / action formatters; the lineup renders its own text
    while hasattr(env, "env"):
        env = env.env
    return env


@dataclass
class Game:
    """One textarena game shared by the two arena participants of a conversation."""

    env: Any
    done: bool = False
    moves: int = 0
    rewards: dict[int, float] | None = None


def _render(observation: list[tuple[int, str, object]]) -> list[str]:
    # player actions are already in the transcript as the seats' own messages
    return [msg.strip() for sender, msg, _ in observation if sender == -1 and msg.strip()]


@dataclass(eq=False)
class ArenaTask:
    """One game: its id, seed, and which seats a random player takes."""

    game_id: str
    seed: int
    random_seats: tuple[str, ...] = ()
    max_moves: int = 30  # moves per seat; a longer game ends as a draw
    max_turns: int = 0

    def __post_init__(self) -> None:
        # two turns per move, and one more: arena_0 judges the last move of player_1
        self.max_turns = 4 * self.max_moves + 1

    @property
    def columns(self) -> dict[str, object]:
        return {"game_id": self.game_id, "seed": self.seed}

    def prompt(self) -> list[Message]:
        return []

    def lineup(self, seat: Callable[[str], Policy]) -> list[Participant]:
        import textarena

        env = _raw(textarena.make(self.game_id))
        env.reset(num_players=2, seed=self.seed)
        game = Game(env=env)
        first = env.state.current_player_id  # the seat the game asks first speaks first
        out: list[Participant] = []
        for k in (first, 1 - first):
            out.append(Arena(game, k, self))
            out.append(RandomMover(SEATS[k]) if SEATS[k] in self.random_seats else seat(SEATS[k]))
        return out


class Arena(Environment):
    """Applies the last seat's move, then shows seat `k` the game's news."""

    role = "user"

    def __init__(self, game: Game, k: int, task: ArenaTask):
        self.game, self.k, self.task = game, k, task
        self.name = f"arena_{k}"

    def respond(self, conv: Conversation) -> str | None:
        g, info = self.game, conv.infos
        info.setdefault("invalid_moves", 0)
        mover = 1 - self.k
        last = conv.messages[-1] if conv.messages else None
        if last is not None and last.speaker == SEATS[mover]:
            self._move(conv, mover, last.content)
        if not g.done and g.moves >= 2 * self.task.max_moves:
            self._finish(conv, {0: 0.0, 1: 0.0}, "move limit")
        if g.done:
            return None
        pid, observation = g.env.get_observation()
        assert pid == self.k, f"{self.task.game_id}: player {pid} to move, expected {self.k}"  # see _move
        return "\n".join(_render(observation)) or "Your move."

    def _move(self, conv: Conversation, mover: int, text: str) -> None:
        g = self.game
        g.moves += 1
        done, _ = g.env.step(text)
        if done:
            rewards, _ = g.env.close()
            self._finish(conv, {int(p): float(r) for p, r in rewards.items()}, "game over")
            return
        state = g.env.state
        if state.current_player_id != mover:
            return
        if state.error_count > 0:  # the game rejected the move and asks again
            conv.infos["invalid_moves"] += 1
            self._finish(conv, {mover: -1.0, 1 - mover: 1.0}, f"invalid move by {SEATS[mover]}")
        else:  # a second move in a row (e.g. the other seat must pass): the lineup cannot serve it
            conv.infos["out_of_turn"] = 1
            self._finish(conv, {0: 0.0, 1: 0.0}, "out of turn")

    def _finish(self, conv: Conversation, rewards: dict[int, float], reason: str) -> None:
        g = self.game
        g.done, g.rewards = True, rewards
        r0, r1 = rewards.get(0, 0.0), rewards.get(1, 0.0)
        win0 = 1.0 if r0 > r1 else 0.5 if r0 == r1 else 0.0
        conv.infos["outcome"] = {SEATS[0]: win0, SEATS[1]: 1.0 - win0}
        conv.infos["game_rewards"] = {SEATS[0]: r0, SEATS[1]: r1}
        conv.request_stop(reason)

    def reward_for(self, conv: Conversation, participant: str) -> float | None:
        # arena_0 alone scores, so a seat's reward is counted once
        if self.k != 0 or participant not in SEATS or self.game.rewards is None:
            return None
        return self.game.rewards.get(SEATS.index(participant), 0.0)


_MOVE = re.compile(r"\[[^\[\]\n]{1,20}\]")
_MOVE_LIST = re.compile(r"(available|valid|legal) moves?", re.IGNORECASE)


class RandomMover(Environment):
    """A fixed opponent: a random bracketed move from the game's last message.

    The moves after the message's last "available / valid / legal moves" when it lists them
    (TicTacToe, Othello, SimpleTak do), else any bracketed text; a game that lists none gets
    "[0]", usually an invalid move, so against it this opponent is weak.
    """

    role = "assistant"

    def __init__(self, name: str):
        self.name = name

    def respond(self, conv: Conversation) -> str:
        text = conv.messages[-1].content if conv.messages else ""
        listed = list(_MOVE_LIST.finditer(text))
        text = text[listed[-1].end() :] if listed else text
        moves = [m for m in _MOVE.findall(text) if not m.startswith(("[GAME", "[Player"))]
        rng = random.Random(zlib.crc32(f"{conv.seed}/{self.name}/{conv.turns_taken}".encode()))
        return rng.choice(moves) if moves else "[0]"


class TextArenaSource(TaskSource):
    """Games of one textarena id, with the seats filled by `opponent`."""

    def __init__(
        self, game_id: str, *, opponent: Opponent = "self", eval_fraction: float = 0.1, max_moves: int = 30
    ):
        import textarena
        from textarena.envs.registration import ENV_REGISTRY
        from textarena.state import TwoPlayerState

        if opponent not in ("self", "random", "frozen"):
            raise ValueError(f"textarena: opponent must be 'self', 'random' or 'frozen', got {opponent!r}")
        if game_id not in ENV_REGISTRY:
            raise ValueError(f"textarena: no game {game_id!r} in textarena's registry")
        why = refusal(game_id)
        if why is not None:
            raise ValueError(f"textarena: {game_id!r} is not supported: {why}")
        check_fraction(eval_fraction, "textarena: eval_fraction")
        try:
            env = _raw(textarena.make(game_id))
            env.reset(num_players=2, seed=0)
        except Exception as exc:
            raise ValueError(f"textarena: {game_id!r} does not start as a two-player game: {exc}") from exc
        if not isinstance(env.state, TwoPlayerState):
            raise ValueError(
                f"textarena: {game_id!r} keeps a {type(env.state).__name__}, not a TwoPlayerState, so "
                "its invalid moves and turn order cannot be read"
            )
        self.game_id, self.opponent, self.eval_fraction, self.max_moves = (
            game_id,
            opponent,
            eval_fraction,
            max_moves,
        )
        self.name = f"textarena:{game_id}"
        self.trained_seats = SEATS if opponent == "self" else SEATS[:1]
        self.frozen_seats = SEATS[1:] if opponent == "frozen" else ()

    def _seeds(self, n: int, seed: int, *, evaluation: bool) -> list[int]:
        rng = random.Random(derive_seed(seed, "ta-eval" if evaluation else "ta-train"))
        out: list[int] = []
        while len(out) < n:
            s = rng.getrandbits(31)
            if held_out(str(s), self.eval_fraction) == evaluation:
                out.append(s)
        return out

    def rows(self, n: int, *, seed: int) -> list[ArenaTask]:
        randoms = ("player_1",) if self.opponent == "random" else ()
        return [
            ArenaTask(self.game_id, s, randoms, self.max_moves)
            for s in self._seeds(n, seed, evaluation=False)
        ]

    def eval_rows(self, n: int, *, seed: int) -> list[ArenaTask]:
        """Per seat, `n` games with the random player in the other seat."""
        seeds = self._seeds(n, seed, evaluation=True)
        return [
            ArenaTask(self.game_id, s, tuple(o for o in SEATS if o != mine), self.max_moves)
            for mine in SEATS
            for s in seeds
        ]

    def option_defaults(self) -> dict[str, object]:
        return {
            **LONG_CONVERSATIONS,
            "max_new_tokens": 16,
        }  # a move (`[col 4]`) and a word or two

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "opponent": self.opponent,
            "eval_fraction": self.eval_fraction,
            "max_moves": self.max_moves,
        }


def source(
    game_id: str, opponent: Opponent = "self", *, eval_fraction: float = 0.1, max_moves: int = 30
) -> TextArenaSource:
    """The task source of `--task textarena:GAME_ID`."""
    return TextArenaSource(game_id, opponent=opponent, eval_fraction=eval_fraction, max_moves=max_moves)
