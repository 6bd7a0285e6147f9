"""`--task verifiers:ENV`: environments from a user's file, their rollouts against the real
endpoint (a scripted engine: the test is about the environment's plumbing, not sampling)."""

from __future__ import annotations

import asyncio
import signal

import openai
import pytest
from support.verifiers_envs import write

from interlens_mcore.agents.server import serve
from interlens_mcore.agents.task import AgentTasks
from interlens_mcore.engines.base import Generation
from interlens_mcore.tasks.registry import resolve_task
from interlens_mcore.tasks.verifiers_env import EnvironmentRollout, VerifiersRows


class Scripted:
    """Answers the calls with the given texts, in order."""

    name = "policy"

    def __init__(self, tokenizer, texts, max_context=4096):
        self.tok, self.texts, self.max_context = tokenizer, list(texts), max_context

    def generate(self, requests):
        out = []
        for _ in requests:
            ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
            out.append(Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"))
        return out


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    return write(tmp_path_factory.mktemp("vf"))


def _play(source, tokenizer, texts, row, max_context=4096):
    agent = source.agent
    assert isinstance(agent, EnvironmentRollout)
    with serve(Scripted(tokenizer, texts, max_context), tokenizer) as ep:

        async def main():
            client = openai.AsyncOpenAI(base_url=ep.url("s"), api_key="x", max_retries=0)
            try:
                return await agent(client, row)
            finally:
                await client.close()

        return asyncio.run(main()), ep.sessions["s"]


def test_single_turn_reward_is_the_rubric_and_success_its_correct_metric(envs, tiny):
    _, tok = tiny
    source = resolve_task(f"verifiers:{envs}", {"num_rows": 10})
    assert isinstance(source, AgentTasks) and source.name == f"verifiers:{envs}"
    row = next(r for r in source.rows(10, seed=0) if r.columns["answer"] == "3")
    out, session = _play(source, tok, ["3"], row)
    # correct (1.0 x 1) + starts_with_digit (1.0 x 0.5)
    assert out["reward"] == 1.5 and out["success"] == 1.0
    assert out["verifiers/correct"] == 1.0 and out["verifiers/starts_with_digit"] == 1.0
    assert session.calls == 1 and session.branches == 0
    out, _ = _play(source, tok, ["7 or so"], row)
    assert out["reward"] == 0.5 and out["success"] == 0.0  # opens with a digit, not the one asked for
    out, _ = _play(source, tok, ["three"], row)
    assert out["reward"] == 0.0 and out["success"] == 0.0


def test_tool_env_calls_the_tool_through_the_endpoint(envs, tiny):
    _, tok = tiny
    source = resolve_task(f"verifiers:{envs}:tool_env", {"max_turns": 3})
    row = source.rows(1, seed=0)[0]
    a, b = (int(x) for x in row.columns["question"].removeprefix("what is ").rstrip("?").split(" + "))
    call = f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    out, session = _play(source, tok, [call, f"it is {a + b}"], row)
    assert out["verifiers/add_calls"] == 1.0 and out["verifiers/num_turns"] == 2.0
    assert out["reward"] == 1.0 and out["success"] == 1.0  # no "correct" metric: reward >= 1
    assert session.calls == 2 and session.branches == 0  # the tool's answer extended the session
    # an empty reply is the policy's doing: scored as it ended, the error kept
    out, _ = _play(source, tok, [""], row)
    assert out["reward"] == 0.0 and out["verifiers_error"].startswith("EmptyModelResponseError")


def test_over_the_context_ends_the_rollout_truncated(envs, tiny):
    _, tok = tiny
    source = resolve_task(f"verifiers:{envs}", {})
    # verifiers reads "context length" in the endpoint's error as an overlong prompt
    out, session = _play(source, tok, [], source.rows(1, seed=0)[0], max_context=8)
    assert out["verifiers_stop"] == "prompt_too_long" and out["reward"] == 0.0
    assert session.truncated and session.calls == 0


def test_an_error_not_of_the_policy_fails_the_sample(envs, tiny):
    _, tok = tiny
    source = resolve_task(f"verifiers:{envs}", {"sampling_args": {"beam_width": 2}})
    with pytest.raises(RuntimeError, match="the rollout failed: ModelError") as info:
        _play(source, tok, ["3"], source.rows(1, seed=0)[0])
    assert "beam_width" in str(info.value.__cause__.__cause__)  # the endpoint's 400, named


def test_rows_are_seeded_and_evaluation_never_trains(envs):
    source = resolve_task(f"verifiers:{envs}", {"num_rows": 20})
    rows = source.source
    assert isinstance(rows, VerifiersRows)
    first = [r.columns["example_id"] for r in rows.rows(30, seed=5)]
    assert first == [r.columns["example_id"] for r in rows.rows(30, seed=5)]
    assert first != [r.columns["example_id"] for r in rows.rows(30, seed=6)]
    held = {r.columns["example_id"] for r in rows.eval_rows(100, seed=0)}
    assert len(held) == 2 and not held & set(first)  # eval_fraction 0.1 of 20 rows, never drawn
    assert len(set(first[:18])) == 18  # a whole permutation of the 18 training rows first
    # an environment with its own eval_dataset evaluates on it
    tools = resolve_task(f"verifiers:{envs}:tool_env", {}).source
    assert [r.columns["answer"] for r in tools.eval_rows(3, seed=0)] == ["101", "102", "103"]


def test_an_installed_environment_by_its_id(envs, tmp_path, monkeypatch):
    # an installed environment is a module named as its id with "-" read as "_"
    (tmp_path / "vf_digits.py").write_text(envs.read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    source = resolve_task("verifiers:vf-digits", {"num_rows": 10})
    env = source.agent.env
    assert env.env_id == "vf-digits" and env.env_args == {"num_rows": 10}  # verifiers' own loader
    assert len(source.source.rows(4, seed=0)) == 4


def test_the_trainers_signal_handlers_survive_loading(envs):
    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        resolve_task(f"verifiers:{envs}", {})
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize(
    "spec, args, expected",
    [
        (
            "verifiers:no_such_env_here",
            {},
            "no installed environment module 'no_such_env_here' (from 'no_such_env_here'); expected an "
            "installed verifiers environment's id, a path to a .py file defining load_environment",
        ),
        ("verifiers:{envs}:nope", {}, "has no 'nope'"),
        ("verifiers:{envs}", {"num_rowz": 3}, "--task-arg num_rowz: verifiers:{envs} takes no num_rowz"),
        ("verifiers:{envs}", {"success_metric": "right"}, "success_metric 'right' is not a metric"),
        ("verifiers:{envs}:not_an_env", {}, "the function returned int, expected a verifiers Environment"),
    ],
)
def test_bad_input_names_it(envs, spec, args, expected):
    with pytest.raises(ValueError) as info:
        resolve_task(spec.format(envs=envs), args)
    assert expected.format(envs=envs) in str(info.value)


def test_without_verifiers_the_hint_names_the_agents_extra(monkeypatch):
    import sys

    from interlens_mcore.tasks.families import make_source

    monkeypatch.setitem(sys.modules, "verifiers", None)  # an import of it fails as if not installed
    monkeypatch.delitem(sys.modules, "interlens_mcore.tasks.verifiers_env", raising=False)
    hint = r"needs the package 'verifiers' .*install interlens_mcore\[agents\]"
    with pytest.raises(ValueError, match=hint):
        make_source("verifiers:env.py")
