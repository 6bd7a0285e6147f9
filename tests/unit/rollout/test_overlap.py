"""co_step's overlap: environment and tool turns of one slice run while the engine generates
another's, and nothing a conversation produces changes."""

import asyncio
import threading

import pytest
import torch

from interlens_mcore import (
    Conversation,
    Environment,
    HFEngine,
    MaxTurns,
    Message,
    Policy,
    RolloutError,
    SamplingParams,
    Status,
    co_step,
)


class Hint(Environment):
    """Async feedback that ends some conversations early, so slices finish at different rounds."""

    name = "env"

    def __init__(self, secret: int, delay_s: float = 0.0):
        self.secret, self.delay_s = secret, delay_s

    async def respond(self, conv):
        await asyncio.sleep(self.delay_s)
        if self.secret % 3 == 0 and conv.turns_taken >= 3:
            conv.end(Status.STOPPED, "guessed")
            return None
        return f"{self.secret} is higher" if conv.turns_taken % 4 == 1 else "lower"


@pytest.fixture(scope="module")
def engine(tiny):
    model, tok = tiny
    return HFEngine(model, tok)


def _convs(engine, tok, n, turns=8, temperature=1.0):
    pol = Policy("agent", engine, tok, SamplingParams(temperature=temperature, max_new_tokens=8))
    return [
        Conversation(
            [pol, Hint(i)],
            [Message(speaker="user", content=f"guess {i}")],
            run_until=MaxTurns(turns),
            id=f"c{i}",
        )
        for i in range(n)
    ]


def _seen(convs):
    return [(c.status, c.turns_taken, c.trajectories()[0].token_ids) for c in convs]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_overlap_gives_the_same_conversations(engine, tiny, temperature):
    _, tok = tiny
    reference = _convs(engine, tok, 7, temperature=temperature)
    co_step(reference, turns=None, group_seed=3)
    assert len({c.turns_taken for c in reference}) > 1  # uneven ends
    for overlap in (2, 3, 7, 9):  # 9: more slices than conversations, some empty
        convs = _convs(engine, tok, 7, temperature=temperature)
        co_step(convs, turns=None, group_seed=3, overlap=overlap)
        assert _seen(convs) == _seen(reference), f"overlap={overlap}"
    # with `turns`, the same limit per conversation, and a later call continues them
    stepped = _convs(engine, tok, 7, temperature=temperature)
    co_step(stepped, turns=2, group_seed=3, overlap=2)
    assert all(c.turns_taken == 2 for c in stepped)
    co_step(stepped, turns=None, group_seed=3, overlap=2)
    assert _seen(stepped) == _seen(reference)


class Handshake:
    """An engine whose generate waits for an environment turn of a conversation it is not
    generating for, to run meanwhile.

    Without overlap every environment turn runs before or after generate, never during it, so
    the wait runs out."""

    def __init__(self, inner, wait_s):
        self.inner, self.name, self.max_context, self.stats = (
            inner,
            inner.name,
            inner.max_context,
            inner.stats,
        )
        self.wait_s, self.generating = wait_s, None  # the tags of the rows being generated
        self.other_ran = threading.Event()
        self.waited: list[bool] = []

    def generate(self, requests):
        self.other_ran.clear()
        self.generating = {r.tag for r in requests}
        # the first call has no environment turn to wait for: nothing was generated before it
        self.waited.append(self.other_ran.wait(timeout=self.wait_s) if self.waited else None)
        self.generating = None
        return self.inner.generate(requests)


class Signal(Environment):
    name = "env"

    def __init__(self, spy):
        self.spy = spy

    async def respond(self, conv):
        # until some generate call runs beside this turn; a slice's last turns have none
        for _ in range(int(min(self.spy.wait_s, 2.0) / 0.01)):
            busy = self.spy.generating
            if busy is not None and conv.id not in busy:
                self.spy.other_ran.set()
                break
            await asyncio.sleep(0.01)
        return "lower"


@pytest.mark.parametrize("overlap,wait_s", [(2, 10.0), (1, 0.3)])
def test_environment_turns_run_while_the_engine_generates(engine, tiny, overlap, wait_s):
    _, tok = tiny
    spy = Handshake(engine, wait_s)
    pol = Policy("agent", spy, tok, SamplingParams(temperature=1.0, max_new_tokens=4))
    convs = [
        Conversation(
            [pol, Signal(spy)],
            [Message(speaker="user", content=f"hi {i}")],
            run_until=MaxTurns(6),
            id=f"c{i}",
        )
        for i in range(4)
    ]
    co_step(convs, turns=None, overlap=overlap)
    assert all(c.turns_taken == 6 for c in convs)
    if overlap == 1:  # the check can fail: without overlap no generate call sees an environment turn
        assert spy.waited == [None, False, False]
    else:  # every call after the first has another slice's environment turn beside it
        assert spy.waited == [None] + [True] * 5, spy.waited


def test_a_failing_environment_in_the_other_slice_fails_the_rollout(engine, tiny):
    _, tok = tiny

    class Breaks(Environment):
        name = "env"

        async def respond(self, conv):
            if conv.turns_taken >= 3:
                raise KeyError("no such tool")
            return "lower"

    pol = Policy("agent", engine, tok, SamplingParams(temperature=1.0, max_new_tokens=4))
    convs = [
        Conversation(
            [pol, Hint(1) if i else Breaks()], [Message(speaker="user", content="x")], run_until=MaxTurns(8)
        )
        for i in range(2)
    ]
    with pytest.raises(RolloutError, match="no such tool"):
        co_step(convs, turns=None, overlap=2)
    assert convs[0].status is Status.FAILED and "KeyError" in convs[0].stop_reason
    # on_sample_error="skip": the other slice's conversation carries on to its end
    convs = [
        Conversation(
            [pol, Hint(1) if i else Breaks()], [Message(speaker="user", content="x")], run_until=MaxTurns(8)
        )
        for i in range(2)
    ]
    co_step(convs, turns=None, overlap=2, on_sample_error="skip")
    assert convs[0].status is Status.FAILED and convs[1].turns_taken == 8


def test_the_engine_generates_on_the_calling_thread_and_environments_beside_it(engine, tiny):
    """torch keeps its thread pool and the caller's grad mode and device: generation stays on the
    calling thread (in a worker thread it ran 1.5 to 2 times slower here); environment turns
    move to the side loop's thread, then that thread ends."""
    _, tok = tiny
    where = {"engine": [], "env": []}

    class Mode:
        name, max_context, stats = engine.name, engine.max_context, engine.stats

        def generate(self, requests):
            where["engine"].append(
                (torch.is_grad_enabled(), threading.current_thread() is threading.main_thread())
            )
            return engine.generate(requests)

    class Where(Environment):
        name = "env"

        async def respond(self, conv):
            where["env"].append(threading.current_thread().name)
            return "lower"

    pol = Policy("agent", Mode(), tok, SamplingParams(temperature=1.0, max_new_tokens=2))
    convs = [
        Conversation([pol, Where()], [Message(speaker="user", content="x")], run_until=MaxTurns(4))
        for _ in range(2)
    ]
    before = threading.active_count()
    with torch.no_grad():
        co_step(convs, turns=None, overlap=2)
    assert where["engine"] and all(m == (False, True) for m in where["engine"])
    assert set(where["env"]) == {"interlens-overlap"} and len(where["env"]) == 4
    assert threading.active_count() == before  # the side loop's thread is gone


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_overlap_is_refused(engine, tiny, bad):
    _, tok = tiny
    with pytest.raises(ValueError, match=r"co_step: overlap must be an int >= 1 \(1: no overlap\), got"):
        co_step(_convs(engine, tok, 1), turns=1, overlap=bad)


def test_the_trainers_rollouts_are_the_same_with_overlap(engine, tiny):
    """What the trainer runs each step (Rollouter over guess-a-number rows): the same samples,
    tokens, environment replies and ends with --overlap 2 as without."""
    from interlens_mcore.distributed import ParallelGroups
    from interlens_mcore.rollout.rollouter import RolloutConfig, Rollouter
    from interlens_mcore.tasks.guess import guess_tasks

    _, tok = tiny
    rows = guess_tasks(4, seed=1)
    seen = []
    for overlap in (1, 2):
        config = RolloutConfig(num_generations=4, max_new_tokens=4, seed=3, overlap=overlap)
        rollouter = Rollouter(
            engine=engine, tokenizer=tok, groups=ParallelGroups(rank=0, world_size=1), config=config
        )
        rollout = rollouter.run(rows, step=2)
        convs = [(c.status, c.stop_reason, [m.content for m in c.messages]) for c in rollout.conversations]
        seen.append(([t.token_ids for t in rollout.trajectories], convs))
    assert seen[0] == seen[1] and len(seen[0][0]) == 16
    assert len({tuple(ids) for ids in seen[0][0]}) > 1  # sampled, not one reply copied


# -- run_multi_turn: the scheduler path (ms-swift's hooks, tools in on_turn_end) -----------------


def _multi_turn(tiny, overlap, n=5, rollout_fn=None, scheduler=None):
    from interlens_mcore.chat import ChatFormat
    from interlens_mcore.rollout.multiturn import (
        EngineRollout,
        MultiTurnRequest,
        ToolScheduler,
        run_multi_turn,
    )

    model, tok = tiny
    chat = ChatFormat(tok)

    class Tools(ToolScheduler):
        """Async tool results; request i finishes after (i % 3) + 1 turns."""

        async def on_turn_end(self, request, response_choice, current_turn):
            await asyncio.sleep(0.001)
            return {"done": current_turn > request.index % 3}

    rollout_fn = rollout_fn or EngineRollout(HFEngine(model, tok), chat, seed=3)
    cfg = SamplingParams(temperature=1.0, max_new_tokens=5)
    requests = [
        MultiTurnRequest.from_messages(chat, [{"role": "user", "content": f"question {i}"}], index=i)
        for i in range(n)
    ]
    first = rollout_fn(requests, cfg)
    outs = run_multi_turn(
        requests,
        first,
        scheduler or Tools(chat, lambda text: f"result {len(text)}"),
        rollout_fn,
        cfg,
        overlap=overlap,
    )
    return [(o.num_turns, o.status, o.to_trajectory().token_ids) for o in outs]


def test_multi_turn_overlap_gives_the_same_outputs(tiny):
    reference = _multi_turn(tiny, 1)
    assert sorted({turns for turns, _, _ in reference}) == [1, 2, 3]
    for overlap in (2, 3, 8):
        assert _multi_turn(tiny, overlap) == reference, f"overlap={overlap}"


def test_multi_turn_hooks_run_while_rollout_fn_answers_another_slice(tiny):
    from interlens_mcore.chat import ChatFormat
    from interlens_mcore.rollout.multiturn import EngineRollout, ToolScheduler

    model, tok = tiny
    chat = ChatFormat(tok)
    inner = EngineRollout(HFEngine(model, tok), chat, seed=3)
    state = {"generating": None, "waited": []}
    other_ran = threading.Event()

    def rollout_fn(requests, cfg):
        if state["generating"] is not None or not requests:  # the first turn, outside the rounds
            return inner(requests, cfg)
        other_ran.clear()
        state["generating"] = {r.index for r in requests}
        state["waited"].append(other_ran.wait(timeout=10))
        state["generating"] = None
        return inner(requests, cfg)

    class Watch(ToolScheduler):
        async def on_turn_end(self, request, response_choice, current_turn):
            for _ in range(200):  # up to 2 s: the first turn's hooks of slice 0 have no call beside them
                busy = state["generating"]
                if busy is not None and request.index not in busy:
                    other_ran.set()
                    break
                await asyncio.sleep(0.01)
            return {"done": current_turn >= 3}

    state["generating"] = set()  # the first turn goes straight through
    first_done = False

    def gated(requests, cfg):
        nonlocal first_done
        if not first_done:
            first_done = True
            state["generating"] = None
            return inner(requests, cfg)
        return rollout_fn(requests, cfg)

    _multi_turn(tiny, 2, n=4, rollout_fn=gated, scheduler=Watch(chat, lambda text: "ok"))
    # two slices, turns 2 and 3 of each: four calls, each beside the other slice's hooks (the
    # first beside slice 1's hooks of the first turn)
    assert state["waited"] == [True] * 4, state["waited"]
