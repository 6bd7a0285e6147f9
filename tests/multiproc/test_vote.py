"""The termination vote on real gloo ranks: uneven turns finish, failures fail everyone fast."""

import time

import pytest
from support.dist import run_ranks


def _guess_convs(engine, tok, rank, turns_by_rank, n=3):
    from interlens_mcore import Conversation, Environment, MaxTurns, Message, Policy, SamplingParams

    class Feedback(Environment):
        name = "env"

        def respond(self, conv):
            return "higher"

    pol = Policy("agent", engine, tok, SamplingParams(temperature=1.0, max_new_tokens=6))
    return [
        Conversation(
            [pol, Feedback()],
            [Message(speaker="user", content=f"guess {rank}-{i}")],
            run_until=MaxTurns(turns_by_rank[rank]),
            id=f"r{rank}c{i}",
        )
        for i in range(n)
    ]


class Counting:
    """Spy around a real engine: counts calls and rows."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.name, self.max_context = engine.name, engine.max_context

    def generate(self, requests):
        self.calls.append(len(requests))
        return self.engine.generate(requests)


def _uneven_co_step(rank, world, tiny_path, turns_by_rank):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import HFEngine, co_step, distributed

    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = Counting(HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path), tok))
    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    convs = _guess_convs(engine, tok, rank, turns_by_rank)
    co_step(convs, turns=None, gather_fn=groups.gather_fn(), rank=groups.rollout_rank)
    return [c.turns_taken for c in convs], engine.calls, [c.trajectories()[0].token_ids for c in convs]


def test_uneven_turns_finish_and_idle_rank_keeps_calling(tiny_path):
    turns = {0: 2, 1: 12}
    (t0, calls0, ids0), (t1, calls1, ids1) = run_ranks(_uneven_co_step, 2, str(tiny_path), turns, timeout=180)
    assert t0 == [2, 2, 2] and t1 == [12, 12, 12]
    # both ranks make one engine call per policy round (6 of them); rank 0 is idle after 1
    assert len(calls0) == len(calls1) == 6
    assert calls0 == [3, 0, 0, 0, 0, 0] and calls1 == [3] * 6
    # the same conversations run on one process give the same tokens
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import HFEngine, co_step

    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path), tok)
    single = _guess_convs(engine, tok, 0, turns) + _guess_convs(engine, tok, 1, turns)
    co_step(single, turns=None)
    assert [c.trajectories()[0].token_ids for c in single] == ids0 + ids1


def _overlapped(rank, world, tiny_path, turns_by_rank, n_by_rank):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import HFEngine, co_step, distributed

    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = Counting(HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path), tok))
    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    convs = _guess_convs(engine, tok, rank, turns_by_rank, n=n_by_rank[rank])
    co_step(convs, turns=None, gather_fn=groups.gather_fn(), rank=groups.rollout_rank, overlap=2)
    return [c.turns_taken for c in convs], engine.calls, [c.trajectories()[0].token_ids for c in convs]


def test_overlap_across_ranks_with_uneven_slices_and_turns(tiny_path):
    # rank 1's single conversation leaves its second slice empty; rank 0 stops after one round
    turns, n = {0: 2, 1: 12}, {0: 3, 1: 1}
    (t0, calls0, ids0), (t1, calls1, ids1) = run_ranks(_overlapped, 2, str(tiny_path), turns, n, timeout=180)
    assert t0 == [2, 2, 2] and t1 == [12]
    # one slice a round: rank 0's slices hold 2 and 1 conversations; rank 1's second slice is
    # empty, so once rank 0 is done its rounds vote and call nothing; both ranks join every call
    assert calls0 == [2, 1] + [0] * 5 and calls1 == [1, 0] + [1] * 5
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import HFEngine, co_step

    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path), tok)
    single = _guess_convs(engine, tok, 0, turns, n=3) + _guess_convs(engine, tok, 1, turns, n=1)
    co_step(single, turns=None)
    assert [c.trajectories()[0].token_ids for c in single] == ids0 + ids1


def _failing_rank(rank, world, tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import (
        Conversation,
        Environment,
        HFEngine,
        MaxTurns,
        Policy,
        RolloutError,
        SamplingParams,
        co_step,
        distributed,
    )

    class Flaky(Environment):
        name = "tool"

        def respond(self, conv):
            if rank == 1 and conv.turns_taken == 3:
                raise KeyError("tool crashed")
            return "ok"

    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path), tok)
    pol = Policy("agent", engine, tok, SamplingParams(max_new_tokens=4))
    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    convs = [Conversation([pol, Flaky()], run_until=MaxTurns(20), id=f"f{rank}")]
    t0 = time.monotonic()
    try:
        co_step(convs, turns=None, gather_fn=groups.gather_fn(), rank=groups.rollout_rank)
    except RolloutError as exc:
        return str(exc), exc.failures, time.monotonic() - t0
    return "no error", [], 0.0


def test_one_rank_failure_fails_every_rank_fast(tiny_path):
    (msg0, f0, s0), (msg1, f1, s1) = run_ranks(_failing_rank, 2, str(tiny_path), timeout=120)
    assert msg0 == msg1 and "rank 1: KeyError: 'tool crashed'" in msg0
    assert [r for r, _ in f0] == [1] and f0 == f1
    assert s0 < 30 and s1 < 30


def _subgroup_layout(rank, world, tp, tiny_path):
    from megatron.core import parallel_state as ps

    from interlens_mcore import co_step, distributed
    from interlens_mcore.engines.hf import HFEngine

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        groups = distributed.build_groups(rollout="model_parallel", vote_timeout_s=60)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tiny_path)
        engine = Counting(HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path), tok))
        convs = _guess_convs(engine, tok, rank, {0: 2, 1: 6}, n=2)
        co_step(convs, turns=None, gather_fn=groups.gather_fn(), rank=groups.rollout_rank)
        return groups.rollout_ranks, len(engine.calls)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("tp", [1, 2])
def test_vote_follows_the_rollout_group(tiny_path, tp):
    (r0, c0), (r1, c1) = run_ranks(_subgroup_layout, 2, tp, str(tiny_path), timeout=120)
    if tp == 1:  # TP=1 x DP=2: each rank is its own rollout group and votes alone
        assert (r0, r1) == ((0,), (1,)) and (c0, c1) == (1, 3)
    else:  # TP=2: both ranks form one rollout group; the idle one keeps calling
        assert r0 == r1 == (0, 1) and c0 == c1 == 3


def _uneven_multi_turn(rank, world, tiny_path, fail_rank, overlap=1):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import (
        ChatFormat,
        EngineRollout,
        HFEngine,
        MultiTurnRequest,
        RolloutError,
        SamplingParams,
        ToolScheduler,
        distributed,
        run_multi_turn,
    )

    tok = AutoTokenizer.from_pretrained(tiny_path)
    chat = ChatFormat(tok)
    engine = Counting(HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path), tok))
    rollout = EngineRollout(engine, chat, seed=3)
    cfg = SamplingParams(temperature=1.0, max_new_tokens=5)

    def tool(text):
        if rank == fail_rank and engine.calls and len(engine.calls) == 3:
            raise ConnectionError("calculator unreachable")
        return "result 7"

    class Calculator(ToolScheduler):
        def check_finished(self, request, response_choice, current_turn):
            return False  # short replies end at their token cap; keep going until max_turns

    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    opening = [{"role": "user", "content": "add 3 and 4"}]
    requests = [MultiTurnRequest.from_messages(chat, opening, index=10 * rank + i) for i in range(2)]
    max_turns = 1 if rank == 0 else 5
    # the first turn, as a trainer's first generate call would produce it
    first = rollout(requests, cfg)
    try:
        outs = run_multi_turn(
            requests,
            first,
            Calculator(chat, tool),
            rollout,
            cfg,
            max_turns,
            groups.gather_fn(),
            rank=groups.rollout_rank,
            overlap=overlap,
        )
    except RolloutError as exc:
        return "error", str(exc), len(engine.calls)
    ids = [o.to_trajectory().token_ids for o in outs]
    return "ok", [o.num_turns for o in outs], len(engine.calls), ids


def test_run_multi_turn_uneven_turns_finish(tiny_path):
    (s0, turns0, calls0, ids0), (s1, turns1, calls1, ids1) = run_ranks(
        _uneven_multi_turn, 2, str(tiny_path), -1, timeout=120
    )
    assert (s0, s1) == ("ok", "ok")
    assert turns0 == [1, 1] and turns1 == [5, 5]
    # first turn + 4 voted rounds on both ranks: the idle rank kept calling with no rows
    assert calls0 == calls1 == 5
    # with two slices a rank (one request each): the same outputs; rank 1's slices take turns,
    # 4 calls each, and rank 0 joins every one of them
    (o0, t0, c0, i0), (o1, t1, c1, i1) = run_ranks(_uneven_multi_turn, 2, str(tiny_path), -1, 2, timeout=120)
    assert (o0, o1, t0, t1) == ("ok", "ok", turns0, turns1) and (i0, i1) == (ids0, ids1)
    assert c0 == c1 == 1 + 2 * 4


def test_run_multi_turn_failure_on_one_rank_fails_both(tiny_path):
    (s0, msg0, _), (s1, msg1, _) = run_ranks(_uneven_multi_turn, 2, str(tiny_path), 1, timeout=120)
    assert s0 == s1 == "error" and msg0 == msg1
    assert "rank 1: ConnectionError: calculator unreachable" in msg0


def _idle_rank_without_engines(rank, world, tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import HFEngine, RolloutError, co_step, distributed

    tok = AutoTokenizer.from_pretrained(tiny_path)
    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    # a collective engine: every forward is an all-reduce over both ranks, as MegatronEngine's
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path), tok, sync_group=groups.rollout)
    convs = _guess_convs(engine, tok, rank, {0: 4}) if rank == 0 else []  # rank 1: nothing, no engines=
    try:
        co_step(convs, turns=None, gather_fn=groups.gather_fn(), rank=groups.rollout_rank)
    except RolloutError as exc:
        return type(exc).__name__, str(exc), exc.failures, [c.turns_taken for c in convs]
    return "no error", "", [], [c.turns_taken for c in convs]


def test_an_idle_rank_without_the_engine_fails_every_rank_before_the_engine_call(tiny_path):
    # on main rank 1 raised inside the round while rank 0 waited in the engine's all-reduce:
    # both hung until the vote's timeout, then failed with gloo errors
    (cls0, msg0, f0, turns0), (cls1, msg1, f1, _) = run_ranks(
        _idle_rank_without_engines, 2, str(tiny_path), timeout=150
    )
    assert cls0 == cls1 == "RolloutValueError" and msg0 == msg1 and f0 == f1
    assert [r for r, _ in f0] == [1]
    assert "ranks [0] generate with engine 'policy'" in msg0 and "co_step(engines=...)" in msg0
    assert turns0 == [0, 0, 0]  # refused before the first engine call
