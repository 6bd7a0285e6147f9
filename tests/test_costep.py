"""co_step on one process: batching is invisible in the tokens, stops and hooks per conversation."""

import pytest
import torch

from interlens_mcore import (
    Conversation,
    Environment,
    GenerationRequest,
    HFEngine,
    MaxTurns,
    Message,
    Policy,
    Predicate,
    SamplingParams,
    Scripted,
    Status,
    TokenBudget,
    co_step,
    schedule_signature,
    stop_when,
)
from interlens_mcore.engine import Generation


class Feedback(Environment):
    """Answers every policy turn with a fixed line that names the conversation's secret."""

    name = "env"

    def __init__(self, secret: int):
        self.secret = secret

    def respond(self, conv):
        return f"number {self.secret} is higher"


class Recording:
    """Wraps a real engine and records every call's rows (a spy, not a fake)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.name, self.max_context = engine.name, engine.max_context

    def generate(self, requests):
        self.calls.append(list(requests))
        return self.engine.generate(requests)


class Endless:
    """A fake engine that never samples a stop token: token 7 forever (the test is about caps)."""

    name, max_context = "endless", 10_000

    def __init__(self):
        self.calls = []

    def generate(self, requests):
        self.calls.append([r.max_new_tokens for r in requests])
        return [
            Generation(
                token_ids=[7] * r.max_new_tokens, logprobs=[-1.0] * r.max_new_tokens, finish_reason="length"
            )
            for r in requests
        ]


@pytest.fixture(scope="module")
def engine(tiny):
    model, tok = tiny
    return HFEngine(model, tok)


def _convs(engine, tok, n, *, temperature=1.0, max_new=10, budget=None, turns_stop=6):
    pol = Policy("agent", engine, tok, SamplingParams(temperature=temperature, max_new_tokens=max_new))
    out = []
    for i in range(n):
        stops = [MaxTurns(turns_stop)] + ([TokenBudget(budget)] if budget else [])
        out.append(
            Conversation(
                [pol, Feedback(i)],
                [Message(speaker="user", content=f"guess {i}")],
                run_until=stops,
                id=f"c{i}",
            )
        )
    return out


def _ids(convs):
    return [c.trajectories()[0].token_ids for c in convs]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_batched_equals_unbatched_for_every_wave_size(engine, tiny, temperature):
    _, tok = tiny
    reference = _convs(engine, tok, 7, temperature=temperature)
    co_step(reference, turns=None, max_batch_size=1)
    for mbs in (2, 3, None):
        batched = _convs(engine, tok, 7, temperature=temperature)
        co_step(batched, turns=None, max_batch_size=mbs)
        assert _ids(batched) == _ids(reference), f"max_batch_size={mbs}"
    # a conversation's tokens do not depend on which others run beside it
    alone = _convs(engine, tok, 7, temperature=temperature)[3:4]
    co_step(alone, turns=None)
    assert _ids(alone)[0] == _ids(reference)[3]
    if temperature > 0:  # different conversations get different random streams
        texts = {tuple(c.trajectories()[0].token_ids[-20:]) for c in reference}
        assert len(texts) == 7


def test_trajectory_is_what_the_engine_saw(engine, tiny):
    _, tok = tiny
    spy = Recording(engine)
    convs = _convs(spy, tok, 3)
    co_step(convs, turns=None)
    last_prompt = {r.tag: list(r.prompt_ids) for call in spy.calls for r in call}
    for c in convs:
        traj = c.trajectories()[0]
        prompt = last_prompt[c.id]
        assert traj.token_ids[: len(prompt)] == prompt
        sampled = c.messages[-2].token_ids  # the policy spoke last but one (env answered)
        assert traj.token_ids[len(prompt) : len(prompt) + len(sampled)] == sampled
        # loss mask 1 exactly on sampled ids, one logprob each
        own = [m for m in c.messages if m.speaker == "agent"]
        assert sum(traj.loss_mask) == sum(len(m.token_ids) for m in own)
        assert traj.rollout_logprobs == [lp for m in own for lp in m.logprobs]
        assert traj.logprobs_complete and traj.status is Status.STOPPED


def test_token_budget_lands_exactly_and_per_row_caps_leave_mates_alone(tiny):
    _, tok = tiny
    eng = Endless()
    pol = Policy("agent", eng, tok, SamplingParams(max_new_tokens=8))
    tight = Conversation([pol, Feedback(0)], run_until=TokenBudget(19, per_turn=8), id="tight")
    loose = Conversation([pol, Feedback(1)], run_until=MaxTurns(6), id="loose")
    co_step([tight, loose], turns=None)
    # tight: turns of 8, 8, then the 3 left (19 = 8 + 8 + 3); loose keeps 8 every turn
    assert eng.calls == [[8, 8], [8, 8], [3, 8]]
    gen = sum(len(m.token_ids) for m in tight.messages if m.speaker == "agent")
    assert gen == 19 and tight.stop_reason == "TokenBudget"
    assert loose.turns_taken == 6 and loose.stop_reason == "MaxTurns"


def test_ambient_condition_is_per_conversation_and_counted_once(tiny):
    _, tok = tiny
    eng = Endless()
    pol = Policy("agent", eng, tok, SamplingParams(max_new_tokens=4))
    shared = TokenBudget(10)
    convs = [Conversation([pol, Feedback(i)], run_until=shared, id=f"a{i}") for i in range(3)]
    with stop_when(shared, MaxTurns(50)):
        co_step(convs, turns=None)
    for c in convs:  # each spends its own 10 (4 + 4 + 2), not a third of a shared 10, nor 5
        assert sum(len(m.token_ids) for m in c.messages if m.speaker == "agent") == 10
    assert shared.used == 0  # the user's object is never mutated


def test_turns_counts_and_none_runs_until_stops(tiny):
    _, tok = tiny
    pol = Policy("agent", Endless(), tok, SamplingParams(max_new_tokens=2))
    c = Conversation([pol, Feedback(0)], run_until=MaxTurns(5), id="x")
    co_step([c], turns=2)
    assert c.turns_taken == 2 and c.status is Status.MAX_TURNS
    unbounded = Conversation([pol, Feedback(0)], id="forever")
    with pytest.raises(RuntimeError, match="still running after 9 rounds"):
        co_step([unbounded], turns=None, max_rounds=9)


def test_hooks_keep_edit_drop(engine, tiny):
    _, tok = tiny
    pol = Policy("agent", Endless(), tok, SamplingParams(max_new_tokens=3))

    def censor(conv, msg):
        if msg.speaker == "env" and conv.turns_taken == 1:
            return None  # drop the first environment reply
        if msg.speaker == "agent" and conv.turns_taken == 2:
            return Message(
                speaker="agent",
                content="edited",
                role="assistant",
                token_ids=msg.token_ids,
                logprobs=msg.logprobs,
            )
        return msg

    c = Conversation([pol, Feedback(5)], hooks=[censor], run_until=MaxTurns(4), id="h")
    co_step([c], turns=None)
    assert [m.speaker for m in c.messages] == ["agent", "agent", "env"]
    assert c.messages[1].content == "edited" and c.messages[1].edited
    traj = c.trajectories()[0]
    assert sum(traj.loss_mask) == 3  # only the kept, unedited turn is trained
    assert tok.decode(traj.token_ids).count("edited") == 1

    def bad(conv, msg):
        return "not a message"

    c = Conversation([pol, Feedback(5)], hooks=[bad], run_until=MaxTurns(2), id="badhook")
    with pytest.raises(ValueError, match="badhook.*hook 'bad'.*expected a Message"):
        co_step([c], turns=None)


def test_mixed_lineups_form_separate_groups(engine, tiny):
    _, tok = tiny
    spy = Recording(engine)
    hot = Policy("agent", spy, tok, SamplingParams(temperature=1.0, max_new_tokens=4))
    cold = Policy("agent", spy, tok, SamplingParams(temperature=0.0, max_new_tokens=4))
    other = Policy("critic", spy, tok, SamplingParams(temperature=1.0, max_new_tokens=4))
    convs = [
        Conversation([p, Feedback(i)], run_until=MaxTurns(2), id=f"m{i}")
        for i, p in enumerate([hot, cold, other, hot, cold, other])
    ]
    sigs = {schedule_signature(c, None) for c in convs}
    assert len(sigs) == 3
    co_step(convs, turns=None)
    assert len(spy.calls) == 3  # one call per signature group, never mixed settings
    for call in spy.calls:
        assert len({r.temperature for r in call}) == 1 and len(call) == 2
    # a lineup that starts elsewhere in its cycle is another group too
    late = Conversation([Feedback(0), hot], id="late")
    assert schedule_signature(late, 2) != schedule_signature(convs[0], 2)


def test_two_policies_in_one_conversation(engine, tiny):
    _, tok = tiny
    alice = Policy("alice", engine, tok, SamplingParams(max_new_tokens=5))
    bob = Policy("bob", engine, tok, SamplingParams(max_new_tokens=5), train_turns="last")
    c = Conversation(
        [alice, bob, Scripted("judge", ["go on"] * 3)],
        [Message(speaker="host", content="debate")],
        run_until=MaxTurns(6),
        id="d",
    )
    co_step([c], turns=None)
    ta, tb = c.trajectories()
    assert (ta.participant, tb.participant) == ("alice", "bob")
    a_ids = [t for m in c.messages if m.speaker == "alice" for t in m.token_ids]
    assert [t for t, k in zip(ta.token_ids, ta.loss_mask) if k] == a_ids
    b_last = [m for m in c.messages if m.speaker == "bob"][-1].token_ids
    assert [t for t, k in zip(tb.token_ids, tb.loss_mask) if k] == b_last
    assert len(tb.turns) == 1 and len(ta.turns) == 2
    # bob sees alice's turns rendered as a user message, not as his own
    assert tok.decode(tb.token_ids).count("<|im_start|>assistant") == 2


def test_out_of_memory_splits_the_wave(tiny):
    _, tok = tiny

    class Small(Endless):
        def generate(self, requests):
            if len(requests) > 2:
                raise torch.OutOfMemoryError("too big")
            return super().generate(requests)

    eng = Small()
    pol = Policy("agent", eng, tok, SamplingParams(max_new_tokens=2))
    convs = [Conversation([pol, Feedback(i)], run_until=MaxTurns(1), id=f"o{i}") for i in range(5)]
    co_step(convs, turns=None)
    assert all(len(c.messages[0].token_ids) == 2 for c in convs)
    assert sorted(len(call) for call in eng.calls) == [1, 2, 2]


def test_bad_inputs_name_the_conversation(engine, tiny):
    _, tok = tiny
    short = HFEngine(engine.model, tok, name="short", max_context=16)
    pol = Policy("agent", short, tok, SamplingParams(max_new_tokens=4))
    long_prompt = [Message(speaker="user", content="guess the number " * 20)]
    c = Conversation([pol], long_prompt, run_until=MaxTurns(1), id="toolong")
    with pytest.raises(ValueError, match="'toolong'.*does not fit the engine's context of 16"):
        co_step([c], turns=None)

    class Weird(Environment):
        name = "weird"

        def respond(self, conv):
            return 42

    pol = Policy("agent", Endless(), tok, SamplingParams(max_new_tokens=1))
    c = Conversation([pol, Weird()], run_until=MaxTurns(3), id="w")
    fine = Conversation([pol, Scripted("env", ["ok"] * 3)], run_until=MaxTurns(3), id="fine")
    with pytest.raises(ValueError, match="conversation w: participant 'weird' returned int"):
        co_step([c, fine], turns=None)
    # the conversation whose turn failed says so; its neighbour was merely cut short
    assert c.status is Status.FAILED and "returned int" in c.stop_reason
    assert fine.status is Status.RUNNING and fine.turns_taken == 2
    with pytest.raises(ValueError, match="max_batch_size"):
        co_step([c], turns=1, max_batch_size=0)
    with pytest.raises(ValueError, match="names must be unique"):
        Conversation([pol, pol])


def test_environment_can_stop_and_async(tiny):
    _, tok = tiny

    class Judge(Environment):
        name = "judge"

        async def respond(self, conv):
            if conv.turns_taken >= 3:
                conv.request_stop("solved")
            return "correct" if conv.turns_taken >= 3 else "wrong"

    pol = Policy("agent", Endless(), tok, SamplingParams(max_new_tokens=1))
    c = Conversation([pol, Judge()], run_until=Predicate(lambda c: False), id="j")
    co_step([c], turns=None)
    assert c.stop_reason == "solved" and c.turns_taken == 4


def test_generation_request_validation():
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        GenerationRequest(prompt_ids=[], max_new_tokens=1, tag="r0")


def test_one_vote_per_policy_round(tiny):
    _, tok = tiny
    pol = Policy("agent", Endless(), tok, SamplingParams(max_new_tokens=1))
    ballots = []

    def gather(items):  # the one-process gather, counting the votes
        ballots.append(items[0])
        return list(items)

    convs = [
        Conversation([Feedback(i), pol, Scripted("tool", ["ok"] * 9)], run_until=MaxTurns(9), id=f"v{i}")
        for i in range(2)
    ]
    co_step(convs, turns=None, gather_fn=gather)
    # 9 turns each = 3 policy turns; the env and tool turns between them need no vote:
    # 3 rounds that generate + the closing vote in which nobody is active
    assert [b.active for b in ballots] == [True, True, True, False]
    assert all(c.turns_taken == 9 for c in convs)
