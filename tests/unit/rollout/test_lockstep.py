"""The lockstep core both drivers run: local phase, vote, aligned engine calls, failures.

Drivers here are small hand-written ones: the tests are about the round, not a driver.
"""

from __future__ import annotations

import asyncio

import pytest
from support.dist import run_ranks

from interlens_mcore.engines.base import check_temperature
from interlens_mcore.rollout.round import (
    Call,
    Driver,
    Need,
    aligned,
    each,
    engine_registry,
    key_of,
    no_running_loop,
    raise_first,
    run_rounds,
    settle,
)
from interlens_mcore.rollout.vote import Ballot, RolloutError, RolloutValueError, local_gather


class Countdown(Driver):
    """Needs `rows` rows of call "a" for `rounds` rounds and one row of "b" in round 2."""

    def __init__(
        self, rounds: int, rows: int = 1, fail_local_at: int | None = None, fail_call_at: int | None = None
    ):
        self.left, self.rows = rounds, rows
        self.fail_local_at, self.fail_call_at = fail_local_at, fail_call_at
        self.locals = 0
        self.calls: list[list[tuple[str, list[int]]]] = []

    async def local(self):
        self.locals += 1
        if self.locals == self.fail_local_at:
            raise ValueError("local phase broke")
        if self.left <= 0:
            return {}
        needs = {"a": Need(engine="pol", rows=self.rows)}
        if self.locals == 2:
            needs["b"] = Need(engine="critic", rows=1)
        return needs

    def call(self, calls):
        self.calls.append([(c.key, c.rows) for c in calls])
        if len(self.calls) == self.fail_call_at:
            raise RuntimeError("engine broke")
        self.left -= 1


def run(driver, **kw):
    return asyncio.run(run_rounds(driver, gather_fn=kw.pop("gather_fn", local_gather), rank=0, **kw))


def test_rounds_run_until_nobody_needs_an_engine():
    d = Countdown(3, rows=2)
    assert run(d) == 3
    # one local phase per round plus the closing one; calls sorted by key, rows per rank
    assert d.locals == 4
    assert d.calls == [[("a", [2])], [("a", [2]), ("b", [1])], [("a", [2])]]


def test_an_idle_rank_joins_every_call_another_rank_needs():
    def gather(items):  # rank 1 needs call "a" with 3 rows for two more votes
        votes.append(items[0])
        busy = len(votes) <= 2
        other = Ballot(rank=1, active=busy, payload={"needs": {"a": ("pol", 3)}} if busy else {})
        return items + [other]

    votes: list[Ballot] = []
    d = Countdown(0)
    assert run(d, gather_fn=gather) == 2
    assert d.calls == [[("a", [0, 3])], [("a", [0, 3])]] and [v.active for v in votes] == [False] * 3


def test_a_local_failure_is_voted_and_raised():
    d = Countdown(5, fail_local_at=2)
    with pytest.raises(RolloutValueError, match="rank 0: ValueError: local phase broke") as ei:
        run(d)
    assert isinstance(ei.value.__cause__, ValueError) and len(d.calls) == 1  # no call after the failure


def test_an_engine_failure_is_voted_before_the_next_local_phase():
    d = Countdown(5, fail_call_at=1)
    with pytest.raises(RolloutError, match="RuntimeError: engine broke") as ei:
        run(d)
    assert not isinstance(ei.value, ValueError) and d.locals == 1  # the failure skipped local phase 2


def test_another_ranks_failure_raises_here_in_the_same_round():
    def gather(items):
        return items + [Ballot(rank=1, active=True, error="KeyError: 'tool'")]

    d = Countdown(5)
    with pytest.raises(RolloutError, match="rank 1: KeyError: 'tool'"):
        run(d, gather_fn=gather)
    assert d.calls == []


def test_a_setup_error_and_the_bound():
    d = Countdown(5)
    with pytest.raises(RolloutValueError, match="bad input"):
        run(d, error=ValueError("bad input"))
    assert d.locals == 0
    with pytest.raises(RuntimeError, match="still running after 2 rounds"):
        run(Countdown(5), bound=2)
    assert run(Countdown(2), bound=2) == 2  # a bound that is just enough is not an error


def test_aligned_calls_and_waves():
    ballots = [
        Ballot(rank=0, active=True, payload={"needs": {"k2": ("pol", 5), "k1": ("pol", 1)}}),
        Ballot(rank=1, active=False),
        Ballot(rank=2, active=True, payload={"needs": {"k2": ("pol", 2)}}),
    ]
    calls = aligned(ballots)
    assert calls == [Call("k1", "pol", [1, 0, 0]), Call("k2", "pol", [5, 0, 2])]
    # every rank makes as many generate calls: ceil(5 / 2) = 3 waves of width 2
    assert calls[1].waves(2) == (3, 2) and calls[1].waves(None) == (1, 5)
    assert Call("k", "pol", [0, 0]).waves(None) == (0, 1)
    assert key_of(("policy", "a")) == key_of(("policy", "a")) != key_of(("policy", "b"))


def test_settle_fails_only_the_items_that_raise():
    failed, errors = {}, []

    async def step(i):
        await asyncio.sleep(0)
        if i % 2:
            raise KeyError(i)

    ok = asyncio.run(settle([0, 1, 2, 3], step, lambda i, e: failed.setdefault(i, e), errors))
    assert ok == [0, 2] and sorted(failed) == [1, 3] and len(errors) == 2
    with pytest.raises(KeyError):
        raise_first(errors)
    errors.clear()
    assert each([1, 2], lambda i: 10 // (i - 1), lambda i, e: None, errors) == [2]
    assert isinstance(errors[0], ZeroDivisionError)
    raise_first([])  # nothing failed: nothing raised


def test_engines_by_name_are_one_object_each():
    class Named:
        def __init__(self, name):
            self.name, self.max_context = name, 8

    a, b = Named("policy"), Named("policy")
    assert engine_registry([a, a, Named("frozen")], "here")["policy"] is a
    with pytest.raises(ValueError, match="here: two different engines are named 'policy'"):
        engine_registry([a, b], "here")


def test_small_checks():
    check_temperature(0.0, "p")
    check_temperature(0.7, "p")
    with pytest.raises(ValueError, match="p: temperature 1e-09 is too small"):
        check_temperature(1e-9, "p")
    no_running_loop("co_step")  # no loop here

    async def inside():
        no_running_loop("co_step")

    with pytest.raises(RuntimeError, match="use `await co_step_async"):
        asyncio.run(inside())


def _two_rank_rounds(rank, world):
    from interlens_mcore import distributed

    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    # rank 0 works 1 round, rank 1 works 3; rank 1 fails in its 3rd local phase when asked to
    d = Countdown(1 if rank == 0 else 3)
    rounds = asyncio.run(run_rounds(d, gather_fn=groups.gather_fn(), rank=groups.rollout_rank))
    failing = Countdown(5, fail_local_at=3 if rank == 1 else None)
    try:
        asyncio.run(run_rounds(failing, gather_fn=groups.gather_fn(), rank=groups.rollout_rank))
        caught = None
    except RolloutError as exc:
        caught = exc.failures
    return rounds, d.calls, len(failing.calls), caught


def test_two_gloo_ranks_make_the_same_calls_and_fail_together():
    (r0, calls0, n0, err0), (r1, calls1, n1, err1) = run_ranks(_two_rank_rounds, 2, timeout=120)
    assert r0 == r1 == 3 and calls0 == calls1  # the idle rank joined every call
    assert calls0 == [[("a", [1, 1])], [("a", [0, 1]), ("b", [0, 1])], [("a", [0, 1])]]
    assert n0 == n1 == 2 and err0 == err1 and err0[0][0] == 1 and "local phase broke" in err0[0][1]


def _mixed_environments(rank, world, tiny_path):
    from support.fakes import Endless, Feedback
    from transformers import AutoTokenizer

    from interlens_mcore import Conversation, MaxTurns, Policy, SamplingParams, co_step, distributed

    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = Endless()
    pol = Policy("agent", engine, tok, SamplingParams(max_new_tokens=2))
    groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
    # every conversation has an environment of its own name, different on each rank
    convs = [
        Conversation(
            [pol, Feedback(i, name=f"env{rank}-{i}")], run_until=MaxTurns(2 + 2 * rank), id=f"r{rank}c{i}"
        )
        for i in range(3)
    ]
    co_step(convs, gather_fn=groups.gather_fn(), rank=groups.rollout_rank)
    return engine.calls


def test_two_ranks_batch_by_speaker_across_environments(tiny_path):
    calls0, calls1 = run_ranks(_mixed_environments, 2, str(tiny_path), timeout=120)
    # one aligned call per policy round, all three rows in it; rank 0 idles in round 2
    assert calls0 == [[2, 2, 2], []] and calls1 == [[2, 2, 2], [2, 2, 2]]
