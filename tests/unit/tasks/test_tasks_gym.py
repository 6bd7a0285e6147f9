"""gymnasium toy-text tasks: the action grammar, text observations, episodes, a tiny-model rollout."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.fakes import ScriptEngine
from support.play import play, scored

from interlens_mcore.engines.hf import HFEngine
from interlens_mcore.grpo.rewards import environment_reward
from interlens_mcore.tasks import gym as gym_tasks
from interlens_mcore.tasks.gym import GAMES, parse_action

LAKE = GAMES["FrozenLake"].actions  # left, down, right, up
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize(
    "text,action",
    [
        ("<action>right</action>", 2),
        ("<action> UP </action>", 3),
        ("I go left. <action>down</action>", 1),  # the tag wins over words
        ("<action>down</action> <action>left</action>", 0),  # the last tag
        ("<action>north</action> left", None),  # a tag with a wrong name is invalid
        ("<action></action>", None),
        ("left then right", 2),  # no tag: the last action word
        ("Left.", 0),
        ("upward leftist", None),  # whole words only
        ("", None),
        ("<action>right", 2),  # unclosed: not a tag, the word counts
        ("2", None),
    ],
)
def test_parse_action(text, action):
    assert parse_action(text, LAKE) == action


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["<action>", "</action>", "left", "up", "x", " ", "\n", "<", "ri", "ght"])).map(
        "".join
    )
)
def test_parse_action_never_raises(text):
    out = parse_action(text, LAKE)
    assert out is None or 0 <= out < len(LAKE)


def _episode(tiny, src, replies, seed=0):
    row = src.rows(1, seed=seed)[0]
    conv = play([row], ScriptEngine(tiny[1], {"row0": list(replies)}), tiny[1])[0]
    return row, conv


def test_frozen_lake_solved(tiny):
    src = gym_tasks.source("FrozenLake-v1", is_slippery=False)
    moves = ["down", "<action>down</action>", "right", "jump!", "right", "down", "right"]
    row, conv = _episode(tiny, src, moves)
    assert conv.infos == {"return": 1.0, "steps": 7, "invalid_actions": 1, "success": 1.0}
    assert conv.stop_reason == "goal"
    invalid = [m.content for m in conv.messages if m.speaker == "env"][3]
    assert invalid.startswith("Invalid action: reply with one of left, down, right, up")
    assert "\x1b" not in row.prompt()[0].content and "@ F F F" in row.prompt()[0].content
    [t] = scored(conv)
    assert environment_reward([t], [row]) == [1.0] and len(t.turns) == 7


def test_hole_out_of_steps_and_penalty(tiny):
    src = gym_tasks.source("FrozenLake-v1", is_slippery=False, max_steps=3, invalid_penalty=-0.1)
    _, conv = _episode(tiny, src, ["right", "down"])  # (0,1) -> (1,1) is a hole
    assert conv.infos["success"] == 0.0 and conv.stop_reason == "episode over"
    _, conv = _episode(tiny, src, ["??", "??", "??"])
    assert conv.stop_reason == "out of steps" and conv.infos["return"] == pytest.approx(-0.3)


def test_cliff_walking_and_taxi_and_blackjack(tiny):
    cliff = gym_tasks.source("CliffWalking-v1")
    _, conv = _episode(tiny, cliff, ["right"] + ["up"] + ["right"] * 11 + ["down"])
    # the first step falls off the cliff (-100, back to start), then 13 steps at -1 to the goal
    assert conv.infos["return"] == -113.0 and conv.infos["success"] == 1.0
    taxi = gym_tasks.source("Taxi-v4", max_steps=2)
    row, conv = _episode(tiny, taxi, ["dropoff", "pickup"], seed=0)
    assert "The passenger is waiting at" in row.prompt()[0].content and "\x1b" not in row.prompt()[0].content
    assert conv.infos["return"] < 0 and conv.infos["success"] == 0.0  # wrong dropoff / pickup: -10 each
    jack = gym_tasks.source("Blackjack-v1")
    row, conv = _episode(tiny, jack, ["I stick"])
    assert conv.infos["steps"] == 1 and conv.infos["success"] == float(conv.infos["return"] > 0)
    assert "The dealer shows" in row.prompt()[0].content


def test_seeds_disjoint_reproducible_and_errors():
    src = gym_tasks.source("Taxi-v4", eval_fraction=0.2)
    assert [r.seed for r in src.rows(20, seed=1)] == [r.seed for r in src.rows(20, seed=1)]
    train = {r.seed for s in range(5) for r in src.rows(50, seed=s)}
    held = {r.seed for s in range(5) for r in src.eval_rows(50, seed=s)}
    assert len(held) > 100 and not train & held
    maps = {r.prompt()[0].content for r in gym_tasks.source("FrozenLake-v1", random_map=True).rows(5, seed=0)}
    assert len(maps) > 1
    with pytest.raises(ValueError, match="no text rendering for 'CartPole-v1'"):
        gym_tasks.source("CartPole-v1")
    with pytest.raises(ValueError, match="cannot make 'FrozenLake-v1'"):
        gym_tasks.source("FrozenLake-v1", flavour=3)
    with pytest.raises(ValueError, match="random_map applies to FrozenLake only"):
        gym_tasks.source("Taxi-v4", random_map=True)


@pytest.mark.parametrize("env_id", ["FrozenLake-v1", "Taxi-v4", "CliffWalking-v1", "Blackjack-v1"])
def test_tiny_model_rollout(tiny, env_id):
    model, tok = tiny
    src = gym_tasks.source(env_id, max_steps=2)
    rows = src.rows(2, seed=0)
    convs = play(rows, HFEngine(model, tok), tok, max_new_tokens=4)
    for c in convs:
        [t] = scored(c)
        assert 1 <= c.infos["steps"] <= 2 and c.infos["invalid_actions"] <= c.infos["steps"]
        assert t.infos["env_reward"] == c.infos["return"] and len(t.turns) == c.infos["steps"]


@pytest.mark.parametrize(
    "env_id,kwargs,moves",
    [
        ("FrozenLake-v1", {"is_slippery": False}, {6}),  # the 4x4 map's shortest path: 6 moves
        ("CliffWalking-v1", {}, {13}),  # up, 11 to the right along the cliff, down
        ("Taxi-v4", {}, set(range(2, 21))),  # to the passenger, pickup, to the destination, dropoff
    ],
)
def test_planned_demonstrations_replay_to_the_goal(tiny, env_id, kwargs, moves):
    src = gym_tasks.source(env_id, **kwargs)
    demos = src.demonstrations(3, seed=4)
    for row, demo in zip(src.rows(3, seed=4), demos, strict=True):  # deterministic: every episode wins
        assert demo[: len(row.prompt())] == [{"role": m.role, "content": m.content} for m in row.prompt()]
        replies = [m["content"] for m in demo if m["role"] == "assistant"]
        assert all(r.startswith("<action>") and r.endswith("</action>") for r in replies)
        _, conv = _episode(tiny, src, replies, seed=4)
        # the rollout's own environment agrees: the goal, in as many moves, each answer as shown
        assert conv.infos["success"] == 1.0 and conv.stop_reason == "goal" and len(replies) in moves
        assert conv.infos["invalid_actions"] == 0 and conv.infos["steps"] == len(replies)
        shown = [m.content for m in conv.messages if m.speaker == "env"]  # the goal ends it: no answer
        assert shown == [m["content"] for m in demo[len(row.prompt()) :] if m["role"] == "user"]
        break  # _episode plays the first row of the seed; the others are checked by plan below


def test_planned_demonstrations_on_slippery_ice_and_random_maps():
    lake = gym_tasks.source("FrozenLake-v1")  # slippery: only the episodes that reached the goal
    demos = lake.demonstrations(4, seed=0)
    assert len(demos) == 4 and all(d[-1]["role"] == "assistant" for d in demos)
    maps = gym_tasks.source("FrozenLake-v1", random_map=True, is_slippery=False)
    assert len({d[0]["content"] for d in maps.demonstrations(4, seed=0)}) > 1  # one plan per map
    with pytest.raises(NotImplementedError, match="only FrozenLake, Taxi and CliffWalking"):
        gym_tasks.source("Blackjack-v1").demonstrations(2, seed=0)


def test_plan_is_a_shortest_path_on_every_state():
    import gymnasium

    env = gymnasium.make("FrozenLake-v1", is_slippery=False)
    best = gym_tasks.plan(env)
    table = env.unwrapped.P

    def steps_to_goal(state: int) -> int | None:
        for k in range(1, 30):
            state, reward, done = table[state][best[state]][0][1:]
            if done:
                return k if reward > 0 else None
        return None

    # the 4x4 map: start 0, goal 15; each reachable state's plan walks a Manhattan path home
    for state in (0, 1, 4, 8, 9, 10, 13, 14):
        row, col = divmod(state, 4)
        assert steps_to_goal(state) == (3 - row) + (3 - col)
    env.close()
