"""TRL environment classes as task sources: one instance per sample, reset text in the prompt,
methods as tools, errors and hangs as tool results, get_reward and environments= as rewards."""

from __future__ import annotations

import json
import time

import pytest
from support.fakes import ScriptEngine
from support.play import play, scored
from support.trl_envs import BY_NAME, Faulty, Lamp, Vault, fewer_tries

from interlens_mcore.rewards import adapt
from interlens_mcore.tasks.dataset import DatasetSource
from interlens_mcore.tools import load_tools, trl_env


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def rows_file(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return DatasetSource(str(path), eval_fraction=0.0)


def vault_rows(tmp_path, n=2):
    rows = [{"prompt": [{"role": "user", "content": "Open it."}], "code": i} for i in range(n)]
    return rows_file(tmp_path, rows)


def test_methods_are_the_tools_and_factories_are_checked():
    assert [m.__name__ for m in trl_env.tool_methods(Vault())] == ["hint", "try_code"]
    assert trl_env.factories_of(Vault, what="x") == {None: Vault}
    assert trl_env.factories_of(BY_NAME, what="x") == BY_NAME
    with pytest.raises(ValueError, match=r"x\['lamp'\]: int is not a class or callable"):
        trl_env.factories_of({"lamp": 3}, what="x")


def test_a_sample_plays_its_own_instance(tmp_path, tiny):
    src = trl_env.source(vault_rows(tmp_path), Vault, tokenizer=tiny[1])
    [row] = [r for r in src.rows(2, seed=0) if r.columns["code"] == 1]
    # two samples of one row (as num_generations makes them): each its own instance
    engine = ScriptEngine(tiny[1], {
        "row0": [call("try_code", code=3), call("hint"), call("try_code", code=1), "done"],
        "row1": ["no idea"],
    })  # fmt: skip
    convs = play([row, row], engine, tiny[1])
    first, second = convs
    # reset's text appended to the last user message; the tools in the template's system message
    assert first.prompt[-1].content == "Open it. The code is one digit."
    assert first.prompt[0].role == "system" and '"name": "try_code"' in first.prompt[0].content
    assert [m.content for m in first.messages if m.role == "tool"] == ["still locked", "odd", "open"]
    assert first.stop_reason == "answered" and second.stop_reason == "answered"
    trajectories = [t for c in convs for t in scored(c)]
    [get_reward] = src.reward_functions()
    assert get_reward.name == "Vault" and get_reward(trajectories, [row, row]) == [1.0, 0.0]
    # a TRL reward function reads each sample's instance as `environments`
    [tries, _] = trl_env.with_environments([adapt(fewer_tries, what="--reward")], src)
    assert tries(trajectories, [row, row]) == pytest.approx([-0.2, 0.0])


def test_a_dict_picks_by_the_environment_column(tmp_path, tiny):
    rows = [
        {"prompt": [{"role": "user", "content": "Light."}], "code": 0, "environment": "lamp"},
        {"prompt": [{"role": "user", "content": "Open."}], "code": 4, "environment": "vault"},
    ]
    src = trl_env.source(rows_file(tmp_path, rows), BY_NAME, tokenizer=tiny[1])
    by_env = {r.columns["environment"]: r for r in src.rows(2, seed=0)}
    script = {"row0": [call("switch", on=True), "lit"], "row1": [call("try_code", code=4), "ok"]}
    engine = ScriptEngine(tiny[1], script)
    lamp, vault = play([by_env["lamp"], by_env["vault"]], engine, tiny[1])
    assert lamp.prompt[-1].content == "Light."  # Lamp.reset returned None
    assert '"switch"' in lamp.prompt[0].content and '"try_code"' not in lamp.prompt[0].content
    trajectories = [t for c in (lamp, vault) for t in scored(c)]
    rewards = {f.name: f(trajectories, [by_env["lamp"], by_env["vault"]]) for f in src.reward_functions()}
    assert rewards == {"Vault": [None, 1.0], "Lamp": [1.0, None]}  # Lamp's get_reward is async
    bad = rows_file(tmp_path, [{"prompt": "x", "code": 1, "environment": "oven"}])
    with pytest.raises(ValueError, match=r"environment='oven'.*expected one of \['lamp', 'vault'\]"):
        trl_env.source(bad, BY_NAME)


def test_a_method_that_raises_or_hangs_is_the_tools_error(tmp_path, tiny):
    src = trl_env.source(vault_rows(tmp_path, 1), Faulty, tokenizer=tiny[1], tool_timeout_s=0.5)
    row = src.rows(1, seed=0)[0]
    engine = ScriptEngine(tiny[1], {"row0": [call("explode", size=2), call("hang"), "ok"]})
    start = time.monotonic()
    try:
        [conv] = play([row], engine, tiny[1])
    finally:
        Faulty.released.set()  # the abandoned call's thread ends
    assert time.monotonic() - start < 30  # the hang cost its call's limit, not the rank
    raised, hung = [m.content for m in conv.messages if m.role == "tool"]
    assert raised.startswith("error: ") and "boom of size 2" in raised
    assert hung == "error: tool 'hang' ran past 0.5 s"
    assert conv.stop_reason == "answered" and conv.infos["tool_errors"] == 2


def test_standalone_tools_join_the_environments_and_a_list_loads(tmp_path, tiny):
    tools = load_tools("interlens_mcore.tools.examples:calculator")
    src = trl_env.source(vault_rows(tmp_path, 1), Vault, tools=tools, tokenizer=tiny[1])
    system = src.rows(1, seed=0)[0].prompt()[0].content
    assert all(f'"name": "{n}"' in system for n in ("calculator", "hint", "try_code"))
    # TRL's tools=[fn, ...]: a module attribute holding a list gives each function
    listed = load_tools(f"{__name__}:TOOLS")
    assert [t.name for t in listed] == ["hint", "switch"]


def hint() -> str:
    """A module-level tool.

    Returns:
        Nothing useful.
    """
    return "none"


TOOLS = [hint, Lamp().switch]
