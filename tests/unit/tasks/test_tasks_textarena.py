"""textarena games as two-seat lineups: refusals, seat rewards and outcomes, a tiny-model self-play."""

from __future__ import annotations

import pytest
from support.fakes import ScriptEngine
from support.play import play, scored

from interlens_mcore.engines.hf import HFEngine
from interlens_mcore.grpo.rewards import environment_reward
from interlens_mcore.rollout.conversation import Policy
from interlens_mcore.tasks import textarena as ta_tasks
from interlens_mcore.tasks.textarena import REFUSED, RandomMover

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize(
    "game_id,why",
    [
        ("Chess-v0", "Python 3.12"),
        ("SpellingBee-v0", "NLTK word list"),
        ("Debate-v0", "API key"),
        ("UsedCarNegotiation-v0", "data file is missing"),
        ("KuhnPoker-v0", "private to one player"),
        ("IteratedPrisonersDilemma-v0", "simultaneous moves"),
        ("PigDice-v0", "several times in a row"),
    ],
)
def test_refused_by_name_with_the_reason(game_id, why):
    with pytest.raises(ValueError, match=f"'{game_id}' is not supported: .*{why}"):
        ta_tasks.source(game_id)


def test_other_errors_name_the_input():
    with pytest.raises(ValueError, match="no game 'Tetris-v0'"):
        ta_tasks.source("Tetris-v0")
    with pytest.raises(ValueError, match="does not start as a two-player game"):
        ta_tasks.source("Sudoku-v0")
    with pytest.raises(ValueError, match="opponent must be"):
        ta_tasks.source("TicTacToe-v0", opponent="human")
    assert all(isinstance(v, str) and v for v in REFUSED.values())


def test_seats_follow_the_opponent():
    self_play = ta_tasks.source("TicTacToe-v0")
    assert self_play.trained_seats == ("player_0", "player_1") and self_play.frozen_seats == ()
    frozen = ta_tasks.source("TicTacToe-v0", opponent="frozen")
    assert frozen.trained_seats == ("player_0",) and frozen.frozen_seats == ("player_1",)
    rand = ta_tasks.source("TicTacToe-v0", opponent="random")
    assert rand.rows(2, seed=0)[0].random_seats == ("player_1",) and rand.frozen_seats == ()
    assert [r.seed for r in self_play.rows(5, seed=2)] == [r.seed for r in self_play.rows(5, seed=2)]
    train = {r.seed for s in range(4) for r in self_play.rows(50, seed=s)}
    evals = self_play.eval_rows(30, seed=0)
    assert not train & {r.seed for r in evals} and len(evals) == 60
    # per seat, the trained policy plays against the random player in the other seat
    assert {r.random_seats for r in evals} == {("player_1",), ("player_0",)}


def _game(tiny, moves, **kw):
    src = ta_tasks.source("TicTacToe-v0", **kw)
    row = src.rows(1, seed=0)[0]
    conv = play([row], ScriptEngine(tiny[1], {"row0": list(moves)}), tiny[1])[0]
    return row, conv


def test_a_won_game_gives_seat_rewards_and_outcomes(tiny):
    row, conv = _game(tiny, ["[0]", "[3]", "[1]", "[4]", "[2]"])  # player_0 takes the top row
    assert conv.infos["outcome"] == {"player_0": 1.0, "player_1": 0.0}
    assert conv.infos["game_rewards"] == {"player_0": 1.0, "player_1": -1.0}
    a, b = scored(conv)
    assert (a.participant, b.participant) == ("player_0", "player_1")
    assert environment_reward([a, b], [row, row]) == [1.0, -1.0]
    first = conv.messages[0]
    assert first.speaker == "arena_0" and "You are Player 0" in first.content and "\x1b" not in first.content
    # player_1 learns player_0's move from the game, and reads the board after it
    assert "Player 0 placed their symbol" in conv.messages[2].content
    assert len(a.turns) == 3 and len(b.turns) == 2


def test_an_invalid_move_loses(tiny):
    _, conv = _game(tiny, ["[4]", "[4]"])  # player_1 plays the occupied centre
    assert conv.infos["invalid_moves"] == 1 and conv.stop_reason == "invalid move by player_1"
    assert conv.infos["outcome"] == {"player_0": 1.0, "player_1": 0.0}
    a, b = scored(conv)
    assert (a.infos["env_reward"], b.infos["env_reward"]) == (1.0, -1.0)


def test_move_limit_is_a_draw(tiny):
    _, conv = _game(tiny, ["[0]", "[1]"], max_moves=1)
    assert conv.stop_reason == "move limit" and conv.infos["outcome"] == {"player_0": 0.5, "player_1": 0.5}


def test_random_mover_picks_a_listed_move():
    from interlens_mcore.rollout.conversation import Conversation
    from interlens_mcore.types import Message

    conv = Conversation([RandomMover("player_1")], id="c")
    conv.messages.append(Message(speaker="arena_1", content="e.g. '[9]'\nAvailable Moves: '[2]', '[5]'"))
    assert RandomMover("player_1").respond(conv) in ("[2]", "[5]")


def _ids(t, span):
    return [i for i, m in zip(t.token_ids[span.start : span.end], t.loss_mask[span.start : span.end]) if m]


@pytest.mark.parametrize("opponent", ["self", "random"])
def test_tiny_model_games(tiny, opponent):
    model, tok = tiny
    src = ta_tasks.source("TicTacToe-v0", opponent=opponent, max_moves=3)
    rows = src.rows(3, seed=0) + src.eval_rows(1, seed=0)
    convs = play(rows, HFEngine(model, tok), tok, max_new_tokens=5)
    for c in convs:
        policies = [p.name for p in c.lineup if isinstance(p, Policy)]
        trajectories = scored(c)
        assert [t.participant for t in trajectories] == policies
        assert set(c.infos["outcome"]) == {"player_0", "player_1"} and sum(c.infos["outcome"].values()) == 1.0
        for t in trajectories:
            assert t.infos["env_reward"] == c.infos["game_rewards"][t.participant]
            # a seat whose opponent forfeited on the first move never spoke: no trained tokens
            assert sum(t.loss_mask) == len(t.rollout_logprobs) == sum(len(_ids(t, s)) for s in t.turns)
        assert sum(trajectories[0].loss_mask) > 0  # the first seat always moves


def test_games_without_a_two_player_state_are_refused():
    with pytest.raises(ValueError, match="'SantoriniBaseFixed-v0' keeps a FFAMultiPlayerState"):
        ta_tasks.source("SantoriniBaseFixed-v0")
