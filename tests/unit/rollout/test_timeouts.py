"""Per-step time limits: a slow environment, hook or step ends only its own conversation, with
status TIMEOUT and the turns before it intact; everything else runs as if it were not there.

Limits are generous (LIMIT s against a slow step that would take SLOW s), so a loaded machine
cannot turn a fast step into a timeout; assertions are about statuses and tokens, and the one
bound on wall time only says the run did not wait for the slow step.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from support.dist import run_ranks

from interlens_mcore.chat import ChatFormat
from interlens_mcore.engines.base import Generation, SamplingParams
from interlens_mcore.rollout.conversation import Conversation, Environment, Policy
from interlens_mcore.rollout.costep import co_step
from interlens_mcore.rollout.multiturn import MultiTurnRequest, ResponseChoice, ToolScheduler, run_multi_turn
from interlens_mcore.rollout.stop import MaxTurns
from interlens_mcore.rollout.vote import RolloutError, RolloutValueError
from interlens_mcore.types import Message, Status

LIMIT = 0.5  # seconds; a fast step here takes well under a millisecond
SLOW = 30.0  # what a slow step would take if nobody stopped waiting for it


class Deterministic:
    """A fake engine (the engine is not under test): a row's ids depend on its seed and prompt."""

    name, max_context = "fake", 100_000

    def __init__(self):
        self.calls: list[int] = []

    def generate(self, requests):
        self.calls.append(len(requests))
        out = []
        for r in requests:
            ids = [10 + (r.seed + len(r.prompt_ids) + k) % 200 for k in range(r.max_new_tokens)]
            logprobs = [-0.25 * (k + 1) for k in range(len(ids))]
            out.append(Generation(token_ids=ids, logprobs=logprobs, finish_reason="length"))
        return out


class SyncEnv(Environment):
    """Replies at once, except at turn `slow_at`, where it blocks until released (or SLOW s)."""

    name = "env"

    def __init__(self, slow_at: int | None = None):
        self.slow_at = slow_at
        self.release, self.finished = threading.Event(), threading.Event()
        self.threads: list[threading.Thread] = []

    def respond(self, conv):
        self.threads.append(threading.current_thread())
        turn = conv.turns_taken + 1
        if turn == self.slow_at:
            self.release.wait(SLOW)
            self.finished.set()
            return "late reply"
        return f"reply at turn {turn}"


class AsyncEnv(Environment):
    """Like SyncEnv, awaiting; records whether its slow turn was cancelled."""

    name = "env"

    def __init__(self, slow_at: int | None = None):
        self.slow_at, self.cancelled = slow_at, False

    async def respond(self, conv):
        turn = conv.turns_taken + 1
        if turn == self.slow_at:
            try:
                await asyncio.sleep(SLOW)
            except asyncio.CancelledError:
                self.cancelled = True
                raise
            return "late reply"
        await asyncio.sleep(0)
        return f"reply at turn {turn}"


@pytest.fixture(scope="module")
def tok(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


def make(tok, envs: dict[int, Environment], prefix: str = "c") -> list[Conversation]:
    """Conversation i of a fixed set: policy, then envs[i]; 8 turns. Ids (so seeds) depend on i."""
    pol = Policy("agent", Deterministic(), tok, SamplingParams(max_new_tokens=3))
    return [
        Conversation(
            [pol, env],
            [Message(speaker="user", content=f"task {i}")],
            run_until=MaxTurns(8),
            id=f"{prefix}{i}",
        )
        for i, env in envs.items()
    ]


def snapshot(conv: Conversation) -> tuple:
    """What a conversation produced: transcript and its trajectory in token space."""
    (t,) = conv.trajectories()
    return [m.content for m in conv.messages], t.token_ids, t.loss_mask, t.rollout_logprobs


def test_co_step_slow_environments_end_only_their_conversations(tok):
    slow_at = {1: 4, 3: 4, 4: 2}  # conversation -> the turn its environment hangs on
    envs = {0: SyncEnv(), 1: SyncEnv(4), 2: AsyncEnv(), 3: AsyncEnv(4), 4: SyncEnv(2), 5: AsyncEnv()}
    convs = make(tok, envs)
    t0 = time.monotonic()
    co_step(convs, turns=None, step_timeout_s=LIMIT)
    elapsed = time.monotonic() - t0
    assert elapsed < SLOW / 2  # it did not wait for any slow step
    for i, at in slow_at.items():
        c = convs[i]
        assert c.status is Status.TIMEOUT and c.turns_taken == at - 1
        assert c.stop_reason == f"timeout: env exceeded {LIMIT:g} s at turn {at}"
        (traj,) = c.trajectories()
        assert traj.status is Status.TIMEOUT and traj.infos["stop_reason"] == c.stop_reason
        # its turns so far are what the same conversation makes with a fast environment
        (ref,) = make(tok, {i: SyncEnv()})
        co_step([ref], turns=at - 1)
        assert snapshot(c) == snapshot(ref)
        assert sum(traj.loss_mask) == 3 * (at // 2)  # the policy's turns before the timeout
    assert envs[3].cancelled  # the async one was cancelled at the limit
    # the fast ones are exactly what they are without any slow conversation beside them
    fast = make(tok, {i: SyncEnv() if i == 0 else AsyncEnv() for i in (0, 2, 5)})
    co_step(fast, turns=None)
    for ref in fast:
        c = convs[int(ref.id[1:])]
        assert c.status is ref.status is Status.STOPPED and c.turns_taken == 8
        assert snapshot(c) == snapshot(ref)
    # a sync step that finishes after its timeout changes nothing
    before = snapshot(convs[1])
    envs[1].release.set()
    envs[4].release.set()
    assert envs[1].finished.wait(10) and envs[4].finished.wait(10)
    assert snapshot(convs[1]) == before and "late reply" not in before[0]


def test_own_limit_wins_and_no_limit_runs_inline(tok):
    class Sleepy(SyncEnv):
        def respond(self, conv):
            time.sleep(2 * LIMIT)
            return super().respond(conv)

    # the environment's own timeout_s applies without a default ...
    strict = Sleepy()
    strict.timeout_s = LIMIT
    (c,) = make(tok, {0: strict})
    co_step([c], turns=None)
    assert c.status is Status.TIMEOUT and c.turns_taken == 1
    # ... and wins over a tighter default (each of its 4 turns sleeps 2 * LIMIT < 10 s)
    lenient = Sleepy()
    lenient.timeout_s = 10.0
    (c,) = make(tok, {0: lenient})
    co_step([c], turns=4, step_timeout_s=LIMIT)
    assert c.status is Status.RUNNING and c.turns_taken == 4  # a chunk of 4 turns: it may go on
    assert all(t.daemon and t is not threading.main_thread() for t in lenient.threads)
    # without any limit a sync respond runs inline, as it always did
    plain = SyncEnv()
    (c,) = make(tok, {0: plain})
    co_step([c], turns=None)
    assert c.status is Status.STOPPED and plain.threads == [threading.main_thread()] * 4


def test_an_environments_own_timeout_error_is_a_failure_not_a_timeout(tok):
    class Upstream(Environment):
        name = "env"

        async def respond(self, conv):
            raise TimeoutError("upstream API timed out")

    (c,) = make(tok, {0: Upstream()})
    with pytest.raises(RolloutError, match="TimeoutError: upstream API timed out"):
        co_step([c], turns=None, step_timeout_s=LIMIT)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_bad_limits_are_rejected(tok, bad):
    (c,) = make(tok, {0: SyncEnv()})
    with pytest.raises(ValueError, match=r"co_step: step_timeout_s must be a number of seconds > 0 or None"):
        co_step([c], turns=1, step_timeout_s=bad)
    env = SyncEnv()
    env.timeout_s = bad
    (c,) = make(tok, {0: env}, prefix="bad")
    # carried through the vote, as every per-conversation input error is
    with pytest.raises(RolloutValueError, match=r"conversation bad0: participant 'env' timeout_s must be"):
        co_step([c], turns=1)
    with pytest.raises(ValueError, match=r"run_multi_turn: step_timeout_s must be a number of seconds"):
        run_multi_turn([], [], ToolScheduler(ChatFormat(tok), str), lambda r, c: [], None, step_timeout_s=bad)


# -- run_multi_turn ----------------------------------------------------------------------------
CFG = SamplingParams(max_new_tokens=3)


class Answers:
    """A fake rollout_fn: request i at turn t answers [30 + t, 40 + i, eos]."""

    def __init__(self, chat: ChatFormat):
        self.eos = chat.stop_token_ids[0]

    def answer(self, r: MultiTurnRequest) -> ResponseChoice:
        ids = [30 + r.turn, 40 + r.index, self.eos]
        return ResponseChoice(
            text=f"r{r.index}t{r.turn}", token_ids=ids, logprobs=[-0.5] * 3, finish_reason="stop"
        )

    def __call__(self, requests, config):
        return [self.answer(r) for r in requests]


class SlowTool(ToolScheduler):
    """A tool whose hook or step hangs for the requests named in `slow`: index -> (call, turn)."""

    def __init__(self, chat, slow: dict[int, tuple[str, int]]):
        super().__init__(chat, lambda text: f"saw {len(text)} chars")
        self.slow = slow
        self.release, self.finished = threading.Event(), threading.Event()

    async def on_turn_end(self, request, response_choice, current_turn):
        if self.slow.get(request.index) == ("on_turn_end", current_turn):
            await asyncio.sleep(SLOW)
        return {"rollout_infos": {"hook_turn": current_turn}}

    def step(self, request, response_choice, current_turn):
        result = super().step(request, response_choice, current_turn)
        if self.slow.get(request.index) == ("step", current_turn):
            self.release.wait(SLOW)
            self.finished.set()
            result["rollout_infos"] = {"late": True}
        return result


def multi(chat, indices, slow=None, max_turns=3, step_timeout_s=None):
    rollout = Answers(chat)
    requests = [
        MultiTurnRequest.from_messages(chat, [{"role": "user", "content": f"question {i}"}], index=i)
        for i in indices
    ]
    scheduler = SlowTool(chat, slow or {})
    first = rollout(requests, CFG)
    outs = run_multi_turn(requests, first, scheduler, rollout, CFG, max_turns, step_timeout_s=step_timeout_s)
    return outs, scheduler


def tokens(out) -> tuple:
    t = out.to_trajectory()
    return t.token_ids, t.loss_mask, t.rollout_logprobs, [m["content"] for m in out.request.messages]


def test_run_multi_turn_slow_hook_and_step_end_only_their_requests(tok):
    chat = ChatFormat(tok)
    slow = {1: ("on_turn_end", 2), 2: ("step", 1)}
    t0 = time.monotonic()
    outs, scheduler = multi(chat, range(4), slow, step_timeout_s=LIMIT)
    assert time.monotonic() - t0 < SLOW / 2
    hooked, stepped = outs[1], outs[2]
    assert hooked.status is Status.TIMEOUT and hooked.num_turns == 2
    assert hooked.rollout_infos["timeout"] == f"on_turn_end exceeded {LIMIT:g} s at turn 2"
    assert stepped.status is Status.TIMEOUT and stepped.num_turns == 1
    assert stepped.rollout_infos["timeout"] == f"step exceeded {LIMIT:g} s at turn 1"
    assert hooked.error is None and stepped.error is None  # a timeout is not a failure
    # each ends as a request finished at that turn would: its last response recorded, trained
    (ref_hooked,), _ = multi(chat, [1], max_turns=2)
    (ref_stepped,), _ = multi(chat, [2], max_turns=1)
    assert tokens(hooked) == tokens(ref_hooked) and tokens(stepped) == tokens(ref_stepped)
    assert hooked.to_trajectory().status is Status.TIMEOUT and hooked.to_trajectory().logprobs_complete
    # the others are exactly what they are without the slow requests
    ref_fast, _ = multi(chat, [0, 3])
    for out, ref in zip([outs[0], outs[3]], ref_fast):
        assert out.status is ref.status is Status.MAX_TURNS and tokens(out) == tokens(ref)
    # the step that finishes after its timeout is discarded
    before = tokens(stepped)
    scheduler.release.set()
    assert scheduler.finished.wait(10)
    assert tokens(stepped) == before and "late" not in stepped.rollout_infos


# -- the vote on two ranks -----------------------------------------------------------------------
def _one_rank_times_out(rank, world, tiny_path, step_timeout_s):
    from transformers import AutoTokenizer

    from interlens_mcore import distributed

    tok = AutoTokenizer.from_pretrained(tiny_path)
    chat = ChatFormat(tok)
    gather = None
    if world > 1:
        groups = distributed.build_groups(rollout="world", vote_timeout_s=60)
        gather, rank = groups.gather_fn(), groups.rollout_rank
    kw = {"gather_fn": gather} if gather else {}
    # rank 1's first conversation hangs at turn 4; everything else is fast
    envs = {0: SyncEnv(4 if rank == 1 else None), 1: AsyncEnv()}
    convs = make(tok, envs, prefix=f"r{rank}c")
    co_step(convs, turns=None, rank=rank, step_timeout_s=step_timeout_s, **kw)
    # rank 1's request 10 hangs in its step at turn 2
    rollout = Answers(chat)
    requests = [
        MultiTurnRequest.from_messages(chat, [{"role": "user", "content": "q"}], index=10 * rank + i)
        for i in range(2)
    ]
    scheduler = SlowTool(chat, {10: ("step", 2)})
    outs = run_multi_turn(
        requests,
        rollout(requests, CFG),
        scheduler,
        rollout,
        CFG,
        4,
        rank=rank,
        step_timeout_s=step_timeout_s,
        **kw,
    )
    return (
        [(c.status.value, c.turns_taken, c.trajectories()[0].token_ids) for c in convs],
        [(o.status.value, o.num_turns, o.to_trajectory().token_ids) for o in outs],
    )


def test_a_timeout_on_one_rank_does_not_fail_the_vote(tiny_path):
    (convs0, outs0), (convs1, outs1) = run_ranks(_one_rank_times_out, 2, str(tiny_path), LIMIT, timeout=120)
    assert [s for s, _, _ in convs0] == ["stopped", "stopped"]
    assert [(s, n) for s, n, _ in convs1] == [("timeout", 3), ("stopped", 8)]
    assert [(s, n) for s, n, _ in outs0] == [("max_turns", 4)] * 2
    assert [(s, n) for s, n, _ in outs1] == [("timeout", 2), ("max_turns", 4)]
    # each rank's tokens are what a single process makes of the same work
    for rank, (convs, outs) in enumerate([(convs0, outs0), (convs1, outs1)]):
        assert (convs, outs) == _one_rank_times_out(rank, 1, str(tiny_path), LIMIT)
