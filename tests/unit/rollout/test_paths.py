"""The three rollout paths (lineups, native schedulers, ms-swift schedulers) expand the same rows
into the same samples: seeds, indices, groups, ids, and the `TrajectoryInfo` fields they fill."""

from __future__ import annotations

import pytest
from support.fakes import Says

from interlens_mcore import Environment, Message, TrajectoryInfo
from interlens_mcore.compat.swift import MultiTurnScheduler as SwiftScheduler
from interlens_mcore.compat.swift import SwiftTaskSource
from interlens_mcore.distributed import ParallelGroups
from interlens_mcore.engines.sampler import mix_seed
from interlens_mcore.rollout.multiturn import MultiTurnScheduler
from interlens_mcore.rollout.rollouter import RolloutConfig, Rollouter, expand_rows
from interlens_mcore.types import Status

SECRETS = (7, 3)
SEED, STEP, N = 5, 2, 3


class Judge(Environment):
    """1.0 when the policy's last message names the secret."""

    def __init__(self, secret: int):
        self.secret, self.name = secret, "judge"

    def respond(self, conv):
        return "thanks"

    def reward(self, conv):
        return float(str(self.secret) in conv.messages[-1].content)


class Guess:
    """A lineup row: the policy guesses once, the judge scores it."""

    max_turns = 1

    def __init__(self, secret: int):
        self.secret = secret

    def prompt(self):
        return [Message(speaker="user", content=f"guess {self.secret}")]

    def lineup(self, seat):
        return [seat("policy"), Judge(self.secret)]


class NativeJudge(MultiTurnScheduler):
    async def on_turn_end(self, request, response_choice, current_turn):
        solved = str(request.data["secret"]) in response_choice.text
        return {"done": True, "rollout_infos": {"reward": float(solved)}}

    def step(self, request, response_choice, current_turn):
        raise AssertionError("every request ends at its first turn")


class SwiftJudge(SwiftScheduler):
    async def on_turn_end(self, infer_request, response_choice, current_turn):
        solved = str(infer_request.data_dict["secret"]) in response_choice.message.content
        return {"done": True, "rollout_infos": {"reward": float(solved)}}


def _dict_rows():
    return [{"messages": [{"role": "user", "content": f"guess {s}"}], "secret": s} for s in SECRETS]


def _rollouter(tok):
    says = Says(tok.encode("7", add_special_tokens=False) + [tok.eos_token_id])
    config = RolloutConfig(num_generations=N, max_new_tokens=4, seed=SEED)
    return Rollouter(engine=says, tokenizer=tok, groups=ParallelGroups(rank=0, world_size=1), config=config)


def _record(t):
    info = t.infos
    assert isinstance(info, TrajectoryInfo)
    return {
        "group": t.group,
        "status": t.status,
        "index": info.index,
        "seed": info.seed,
        "conversation": info.conversation,
        "seat": info.seat,
        "turns": info.turns,
        "completion": info.completion,
        "env_reward": info.env_reward,
        "finish_reasons": info.finish_reasons,
        "logprobs_complete": info.logprobs_complete,
        # the whole transcript on every path: the row's opening messages, then the conversation
        "transcript": [(m["role"], m["content"]) for m in info.messages],
        # up to the last sampled token: a lineup's view also holds the template's closing ids
        "token_ids": t.token_ids[: t.turns[-1].end],
        "loss_mask": t.loss_mask[: t.turns[-1].end],
    }


@pytest.fixture
def tok(tiny):
    return tiny[1]


def test_the_same_rows_give_the_same_samples_on_every_path(tok):
    rollouter = _rollouter(tok)
    lineups = rollouter.run([Guess(s) for s in SECRETS], STEP)
    native = rollouter.run(_dict_rows(), STEP, NativeJudge(), reward_key="reward")
    swift = SwiftTaskSource(SwiftJudge(max_turns=1), _dict_rows()).run(rollouter, _dict_rows(), STEP)
    paths = {"lineups": lineups, "native": native, "swift": swift}
    records = {name: [_record(t) for t in r.trajectories] for name, r in paths.items()}
    assert records["native"] == records["lineups"]
    assert records["swift"] == records["lineups"]
    # and what they agree on is the expansion: (row, generation) order, one group per row,
    # indices over the rank's rows, seeds of (seed, step, rank, row, generation)
    expected = [(i, k) for i in range(len(SECRETS)) for k in range(N)]
    first = records["lineups"]
    assert [r["group"] for r in first] == [i for i, _ in expected]
    assert [r["index"] for r in first] == list(range(len(expected)))
    assert [r["seed"] for r in first] == [mix_seed(SEED, STEP, 0, i, k) for i, k in expected]
    assert [r["conversation"] for r in first] == [f"s{STEP}-r0-p{i}-g{k}" for i, k in expected]
    assert [r["env_reward"] for r in first] == [1.0] * N + [0.0] * N  # the engine always says 7
    assert {r["completion"] for r in first} == {"7"} and {r["turns"] for r in first} == {1}
    assert {r["status"] for r in first} == {Status.STOPPED}
    for name, r in paths.items():
        assert [row["secret"] if isinstance(row, dict) else row.secret for row in r.rows] == [
            s for s in SECRETS for _ in range(N)
        ], name


def test_evaluation_samples_agree_and_differ_from_training(tok):
    rollouter = _rollouter(tok)
    lineups = rollouter.evaluate([Guess(s) for s in SECRETS], STEP)
    swift = SwiftTaskSource(SwiftJudge(max_turns=1), _dict_rows()).evaluate(rollouter, _dict_rows(), STEP)
    a, b = ([_record(t) for t in r.trajectories] for r in (lineups, swift))
    assert a == b and [r["conversation"] for r in a] == [f"eval{STEP}-r0-p0-g0", f"eval{STEP}-r0-p1-g0"]
    training = {s.seed for s in rollouter.plan([Guess(s) for s in SECRETS], STEP).samples}
    assert not training & {r["seed"] for r in a}


def test_indices_are_unique_across_ranks_and_rows_expand_in_order():
    ranks = [expand_rows(["a", "b"], num_generations=2, rank=r, stream=(1, 2), tag="s2") for r in range(3)]
    indices = [s.index for samples in ranks for s in samples]
    assert indices == list(range(12))
    assert [(s.row, s.group, s.generation) for s in ranks[1]] == [
        ("a", 0, 0),
        ("a", 0, 1),
        ("b", 1, 0),
        ("b", 1, 1),
    ]
    assert len({s.seed for samples in ranks for s in samples}) == 12
    with pytest.raises(ValueError, match="num_generations must be >= 1, got 0"):
        expand_rows(["a"], num_generations=0, rank=0, stream=(0,), tag="s0")


def test_trajectory_info_reads_fields_and_extras_by_key():
    info = TrajectoryInfo.of({"completion": "hi", "env_reward": 1.0, "tool_calls": 2})
    assert info.completion == "hi" and info.env_reward == 1.0 and info.extra == {"tool_calls": 2}
    assert info["completion"] == "hi" and info["tool_calls"] == 2 and info.get("missing", 0) == 0
    assert "tool_calls" in info and "success" in info and "missing" not in info
    info["success"] = 0.5
    assert info.success == 0.5 and "success" not in info.extra
    with pytest.raises(KeyError):
        info["missing"]
