"""The multi-turn scheduler driver: turns, termination, continuation, the completeness rule,
the vote, and bad input. Fake rollouts where the test is not about the engine."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from interlens_mcore.chat import ChatFormat
from interlens_mcore.engines.base import SamplingParams
from interlens_mcore.engines.hf import HFEngine
from interlens_mcore.rollout.multiturn import (
    EngineRollout,
    MultiTurnError,
    MultiTurnRequest,
    MultiTurnValueError,
    ResponseChoice,
    ToolScheduler,
    run_multi_turn,
)
from interlens_mcore.rollout.vote import Ballot, RolloutError
from interlens_mcore.types import Status

CFG = SamplingParams(temperature=1.0, max_new_tokens=6)
LOGPROBS = [-0.5, -0.25, -0.125]


@pytest.fixture(scope="module")
def chat(tiny):
    return ChatFormat(tiny[1])


class FakeRollout:
    """Answers request i at turn t with ids [30 + t, 40 + i] (+ eos when `stop`)."""

    def __init__(self, chat: ChatFormat, *, stop: bool = True, fail_at_turn: int | None = None):
        self.eos = chat.stop_token_ids[0]
        self.stop, self.fail_at_turn = stop, fail_at_turn
        self.calls: list[list[tuple[int, int]]] = []

    def answer(self, r: MultiTurnRequest) -> ResponseChoice:
        ids = [30 + r.turn, 40 + r.index] + ([self.eos] if self.stop else [])
        return ResponseChoice(
            text=f"r{r.index}t{r.turn}",
            token_ids=ids,
            logprobs=LOGPROBS[: len(ids)],
            finish_reason="stop" if self.stop else "length",
        )

    def __call__(self, requests, config):
        self.calls.append([(r.index, r.turn) for r in requests])
        if requests and requests[0].turn == self.fail_at_turn:
            raise RuntimeError("engine fell over")
        return [self.answer(r) for r in requests]


def make_requests(chat: ChatFormat, n: int, **data) -> list[MultiTurnRequest]:
    return [
        MultiTurnRequest.from_messages(
            chat, [{"role": "user", "content": f"question {i}"}], index=i, data=dict(data)
        )
        for i in range(n)
    ]


def tool(text: str) -> str:
    return f"result {len(text)}"


def test_tool_scheduler_turns_stay_in_token_space(chat):
    requests = make_requests(chat, 2)
    rollout = FakeRollout(chat)
    first = [rollout.answer(r) for r in requests]
    outs = run_multi_turn(requests, first, ToolScheduler(chat, tool), rollout, CFG, max_turns=3)
    assert rollout.calls == [[(0, 2), (1, 2)], [(0, 3), (1, 3)]]
    eos = chat.stop_token_ids[0]
    for i, out in enumerate(outs):
        assert out.num_turns == 3 and out.status == Status.MAX_TURNS and out.finish_reason == "stop"
        traj = out.to_trajectory(group=7)
        # the whole sequence is the last prompt the engine saw plus its last answer
        assert traj.token_ids == out.request.prompt_ids + [33, 40 + i, eos]
        trained = [t for t, m in zip(traj.token_ids, traj.loss_mask) if m]
        assert trained == [31, 40 + i, eos, 32, 40 + i, eos, 33, 40 + i, eos]
        assert traj.rollout_logprobs == LOGPROBS * 3 and traj.infos["logprobs_complete"]
        # turn 2 starts with the template's tail, the tool message rendered once, the opener
        tool_ids = chat.message_ids("tool", tool(f"r{i}t1"))
        assert out.response_token_ids[1] == chat.close_ids(
            "stop"
        ) + tool_ids + chat.generation_prompt_ids() + [
            32,
            40 + i,
            eos,
        ]
        assert [traj.token_ids[s.start : s.end] for s in traj.turns] == [
            [30 + t, 40 + i, eos] for t in (1, 2, 3)
        ]
        assert [m["role"] for m in out.request.messages] == ["user", "assistant", "tool"] * 1 + [
            "assistant",
            "tool",
            "assistant",
        ]
        assert traj.group == 7 and traj.status == Status.MAX_TURNS
    assert requests[0].messages == [{"role": "user", "content": "question 0"}]  # input untouched


class Barrier(ToolScheduler):
    """Every hook of a round waits until all of the round's hooks have started."""

    def __init__(self, chat, n):
        super().__init__(chat, tool)
        self.n, self.rounds = n, {}

    def on_trajectory_start(self, requests):
        for r in requests:
            r.data["started"] = True

    async def on_turn_end(self, request, response_choice, current_turn):
        state = self.rounds.setdefault(current_turn, [0, asyncio.Event()])
        state[0] += 1
        if state[0] == self.n:
            state[1].set()
        await asyncio.wait_for(state[1].wait(), timeout=5)  # hooks run one by one would time out
        return {"rollout_infos": {"hook_turn": current_turn}}


def test_hooks_run_concurrently(chat):
    requests = make_requests(chat, 3)
    rollout = FakeRollout(chat)
    first = [rollout.answer(r) for r in requests]
    outs = run_multi_turn(requests, first, Barrier(chat, 3), rollout, CFG, max_turns=2)
    assert [o.rollout_infos["hook_turn"] for o in outs] == [2, 2, 2]
    assert all(o.request.data["started"] for o in outs)


class DoneAt(ToolScheduler):
    """Hook: done=True at data['done_at'], done=False before it, None when data['hook'] is off."""

    async def on_turn_end(self, request, response_choice, current_turn):
        if not request.data.get("hook", True):
            return None
        done = current_turn == request.data.get("done_at")
        return {"done": done, "rollout_infos": {"last_hook_turn": current_turn}}


def test_done_overrides_check_finished_and_max_turns_caps(chat):
    requests = make_requests(chat, 3)
    requests[0].data["done_at"] = 2  # done before the cap
    requests[2].data["hook"] = False  # check_finished decides: 'length' finishes at once
    rollout = FakeRollout(chat, stop=False)  # every reply is cut: check_finished says finished
    first = [rollout.answer(r) for r in requests]
    outs = run_multi_turn(requests, first, DoneAt(chat, tool), rollout, CFG, max_turns=4)
    # finished in the order 2, 0, 1; outputs stay in request order
    assert [o.request.index for o in outs] == [0, 1, 2]
    assert [o.num_turns for o in outs] == [2, 4, 1]
    assert [o.status for o in outs] == [Status.STOPPED, Status.MAX_TURNS, Status.STOPPED]
    assert outs[1].rollout_infos["last_hook_turn"] == 4
    assert rollout.calls == [[(0, 2), (1, 2)], [(1, 3)], [(1, 4)]]


def test_scheduler_max_turns_through_check_finished(chat):
    requests = make_requests(chat, 1)
    rollout = FakeRollout(chat)
    first = [rollout.answer(r) for r in requests]
    outs = run_multi_turn(requests, first, ToolScheduler(chat, tool, max_turns=2), rollout, CFG)
    assert outs[0].num_turns == 2 and outs[0].status == Status.MAX_TURNS
    assert len(outs[0].to_trajectory().turns) == 2


class Continue(ToolScheduler):
    """Turn 1 is continued inside the assistant's message; later turns get a tool reply."""

    def check_finished(self, request, response_choice, current_turn):
        return False

    def step(self, request, response_choice, current_turn):
        if current_turn == 1:
            return {"infer_request": self.continue_turn(request, response_choice, " result 5")}
        return super().step(request, response_choice, current_turn)


def test_continuation_extends_the_last_turn(chat):
    requests = make_requests(chat, 1)
    rollout = FakeRollout(chat, stop=False)
    first = [rollout.answer(r) for r in requests]
    out = run_multi_turn(requests, first, Continue(chat, tool), rollout, CFG, max_turns=3)[0]
    injected = chat.encode(" result 5")
    assert out.num_turns == 3 and len(out.response_token_ids) == 2
    assert out.response_token_ids[0] == [31, 40] + injected + [32, 40]
    assert out.response_loss_mask[0] == [1, 1] + [0] * len(injected) + [1, 1]
    assert out.rollout_logprobs[0] == LOGPROBS[:2] * 2
    traj = out.to_trajectory()
    p = len(out.prompt_ids)
    assert (traj.turns[0].start, traj.turns[0].end) == (p, p + 4 + len(injected))
    assert traj.rollout_logprobs == LOGPROBS[:2] * 3
    contents = [(m["role"], m["content"]) for m in out.request.messages]
    assert contents[1] == ("assistant", "r0t1 result 5r0t2")
    assert [r for r, _ in contents] == ["user", "assistant", "tool", "assistant"]


class Shaping(ToolScheduler):
    """Masks the middle token of every reply; hands its own logprobs when data['own_lp']."""

    def step(self, request, response_choice, current_turn):
        result = super().step(request, response_choice, current_turn)
        result["response_loss_mask"] = [1, 0, 1]
        if request.data.get("own_lp"):
            result["rollout_logprobs"] = [-9.0, -7.0]
        result["rollout_infos"] = {"shaped": True}
        return result


def test_step_logprobs_preferred_and_completeness_rule(chat):
    requests = make_requests(chat, 2)
    requests[1].data["own_lp"] = True
    rollout = FakeRollout(chat)
    first = [rollout.answer(r) for r in requests]
    outs = run_multi_turn(requests, first, Shaping(chat, tool), rollout, CFG, max_turns=2)
    # request 0: the engine's 3 logprobs against 2 trained tokens in turn 1: dropped, flagged
    bad = outs[0].to_trajectory()
    assert bad.rollout_logprobs is None and bad.infos["logprobs_complete"] is False
    assert bad.num_trained_tokens == 2 + 3 and outs[0].rollout_infos["shaped"]
    # request 1: the step's logprobs win for turn 1; the final turn keeps the engine's
    assert outs[1].rollout_logprobs[0] == [-9.0, -7.0]
    good = outs[1].to_trajectory()
    assert good.rollout_logprobs == [-9.0, -7.0] + LOGPROBS and good.infos["logprobs_complete"]


def test_idle_rank_calls_rollout_fn_while_another_rank_works(chat):
    ballots: list[Ballot] = []

    def gather(items):  # rank 1 still has work for the first two votes
        ballots.extend(items)
        return items + [Ballot(rank=1, active=len(ballots) <= 2)]

    rollout = FakeRollout(chat)
    outs = run_multi_turn([], [], ToolScheduler(chat, tool), rollout, CFG, gather_fn=gather, rank=0)
    assert outs == [] and rollout.calls == [[], []]
    assert [(b.rank, b.active) for b in ballots] == [(0, False)] * 3


def test_finished_rank_keeps_calling_until_the_group_is_done(chat):
    votes = []

    def gather(items):
        votes.append(items[0].active)
        return items + [Ballot(rank=1, active=len(votes) <= 3)]

    requests = make_requests(chat, 1)
    rollout = FakeRollout(chat)
    first = [rollout.answer(r) for r in requests]
    outs = run_multi_turn(requests, first, ToolScheduler(chat, tool), rollout, CFG, 2, gather, rank=0)
    assert votes == [True, False, False, False]
    assert rollout.calls == [[(0, 2)], [], []] and outs[0].num_turns == 2


def test_another_ranks_failure_raises_here_and_keeps_outputs(chat):
    def gather(items):
        return items + [Ballot(rank=1, active=True, error="ValueError: request 9: boom", bad_input=True)]

    requests = make_requests(chat, 1)
    rollout = FakeRollout(chat, stop=False)
    first = [rollout.answer(r) for r in requests]
    with pytest.raises(MultiTurnValueError, match="rank 1: ValueError: request 9: boom") as ei:
        run_multi_turn(requests, first, ToolScheduler(chat, tool), rollout, CFG, gather_fn=gather)
    assert ei.value.__cause__ is None and rollout.calls == []
    assert ei.value.outputs[0].status == Status.STOPPED and ei.value.outputs[0].num_turns == 1


class Faulty(ToolScheduler):
    """Request 0 is done at turn 1, request 1 misbehaves in `mode`, request 2 is well behaved."""

    def __init__(self, chat, mode):
        super().__init__(chat, tool)
        self.mode = mode

    async def on_turn_end(self, request, response_choice, current_turn):
        if request.index == 0:
            return {"done": True}
        if request.index == 1 and self.mode == "hook_not_dict":
            return "yes"
        return None

    def step(self, request, response_choice, current_turn):
        result = super().step(request, response_choice, current_turn)
        if request.index != 1:
            return result
        if self.mode == "no_infer_request":
            del result["infer_request"]
        elif self.mode == "mask_length":
            result["response_loss_mask"] = [1, 1]
        elif self.mode == "mask_values":
            result["response_loss_mask"] = [1, 2, 1]
        elif self.mode == "step_logprobs":
            result["rollout_logprobs"] = [-0.5, math.nan, -0.1]
        elif self.mode == "not_extending":
            nxt = result["infer_request"]
            nxt.prompt_ids = nxt.prompt_ids[:3] + [5] + nxt.prompt_ids[3:]
        return result


@pytest.mark.parametrize(
    "mode, message",
    [
        ("no_infer_request", "request 1 .*step\\(\\) must return a dict with 'infer_request'"),
        ("mask_length", "request 1 .*loss_mask has 2 entries but token_ids has 3"),
        ("mask_values", "request 1 .*loss_mask values must be 0 or 1, got 2"),
        ("step_logprobs", "request 1 .*rollout_logprobs must be finite, got nan"),
        ("engine_logprobs", "request 1 .*rollout_fn logprobs must be finite"),
        ("not_extending", "request 1 .*prompt_ids must extend the previous prompt_ids"),
        ("hook_not_dict", "request 1 .*on_turn_end must return a dict or None"),
    ],
)
def test_bad_input_names_request_and_field_and_keeps_other_work(chat, mode, message):
    requests = make_requests(chat, 3)
    rollout = FakeRollout(chat)
    first = [rollout.answer(r) for r in requests]
    if mode == "engine_logprobs":
        first[1].logprobs = [-0.5, -math.inf, -0.1]
    with pytest.raises(MultiTurnValueError, match=message) as ei:
        run_multi_turn(requests, first, Faulty(chat, mode), rollout, CFG, max_turns=3)
    err = ei.value
    assert isinstance(err, ValueError) and isinstance(err, RolloutError)
    assert isinstance(err.__cause__, ValueError) and "request 1" in str(err.__cause__)
    assert rollout.calls == []  # failed fast: no further engine call
    done, failed, running = err.outputs
    assert done.status == Status.STOPPED and done.to_trajectory().rollout_logprobs == LOGPROBS
    assert failed.status == Status.FAILED and "request 1" in failed.error
    assert running.status == Status.RUNNING and running.response_token_ids[0][:2] == [31, 42]


def test_failures_that_are_not_bad_input(chat):
    requests = make_requests(chat, 2)
    rollout = FakeRollout(chat, fail_at_turn=2)
    first = [rollout.answer(r) for r in requests]
    with pytest.raises(MultiTurnError, match="RuntimeError: engine fell over") as ei:
        run_multi_turn(requests, first, ToolScheduler(chat, tool), rollout, CFG, max_turns=3)
    assert not isinstance(ei.value, ValueError)
    assert [o.num_turns for o in ei.value.outputs] == [1, 1]  # turn 1 of both is kept
    with pytest.raises(MultiTurnValueError, match="got 1 responses for 2 requests"):
        run_multi_turn(requests, first[:1], ToolScheduler(chat, tool), rollout, CFG)


class KeepGoing(ToolScheduler):
    def check_finished(self, request, response_choice, current_turn):
        return False  # the random tiny model rarely stops: let max_turns end it


def rescored_logprobs(model, ids: list[int], mask: list[int]) -> list[float]:
    """Logprob of every mask-1 token under a plain forward over the whole trajectory."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]
    return [float(logp[j - 1, ids[j]]) for j in range(1, len(ids)) if mask[j]]


def test_real_model_trajectory_is_what_the_engine_saw(tiny, chat):
    model, tokenizer = tiny
    rollout = EngineRollout(HFEngine(model, tokenizer), chat, seed=3)
    requests = make_requests(chat, 3)

    def run(reqs):
        first = rollout(reqs, CFG)
        return run_multi_turn(reqs, first, KeepGoing(chat, tool), rollout, CFG, max_turns=3)

    outs = run(requests)
    for out in outs:
        traj = out.to_trajectory()
        assert out.num_turns == 3 and traj.num_trained_tokens == 3 * 6
        assert traj.infos["logprobs_complete"]
        # a plain forward over the trajectory reproduces the engine's logprobs: same tokens
        rescored = rescored_logprobs(model, traj.token_ids, traj.loss_mask)
        assert rescored == pytest.approx(traj.rollout_logprobs, abs=1e-4)
    # seeds per (request, turn): request 1 alone gets the same tokens as in the batch
    alone = run(requests[1:2])[0].to_trajectory()
    assert alone.token_ids == outs[1].to_trajectory().token_ids
    # ... and the seed depends on the request's index: same prompt, other index, other tokens
    twin = run([MultiTurnRequest.from_messages(chat, requests[1].messages, index=5)])[0].to_trajectory()
    assert twin.token_ids[: len(requests[1].prompt_ids)] == requests[1].prompt_ids
    assert twin.token_ids != alone.token_ids


# -- the native API the ms-swift layer builds on ---------------------------------------------------
class Empty(FakeRollout):
    """Turn 2 of every request is an empty reply, and its engine gives no logprobs for it."""

    def answer(self, r):
        if r.turn == 2:
            return ResponseChoice(text="", token_ids=[], logprobs=None, finish_reason="stop")
        return super().answer(r)


def test_an_empty_reply_without_logprobs_keeps_is_correction_on(chat):
    requests = make_requests(chat, 1)
    rollout = Empty(chat)
    first = [rollout.answer(r) for r in requests]
    out = run_multi_turn(requests, first, KeepGoing(chat, tool), rollout, CFG, max_turns=3)[0]
    traj = out.to_trajectory()
    assert out.rollout_logprobs[1] is None and sum(out.response_loss_mask[1]) == 0
    # one logprob per trained token: the empty turn trains nothing and owes none (main: IS off)
    assert traj.infos["logprobs_complete"] and traj.rollout_logprobs == LOGPROBS * 2


def test_an_assistant_prefill_is_continued_not_closed(chat):
    messages = [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "The sum is"}]
    req = MultiTurnRequest.from_messages(chat, messages, index=0)
    opener = chat.generation_prompt_ids()
    assert req.prompt_ids == chat.message_ids("user", "add 2 and 3") + opener + chat.encode("The sum is")
    rollout = FakeRollout(chat)
    out = run_multi_turn([req], [rollout.answer(req)], ToolScheduler(chat, tool), rollout, CFG, max_turns=1)[
        0
    ]
    # messages and tokens agree: one assistant message, opened once, holding prefill + reply
    assert [m["role"] for m in out.request.messages] == ["user", "assistant"]
    assert out.request.messages[1]["content"] == "The sum isr0t1"
    traj = out.to_trajectory()
    text = chat.tokenizer.decode(traj.token_ids)
    assert text.count("<|im_start|>assistant") == 1 and "The sum is" in text


class Cut(ToolScheduler):
    """Continues turn 1 with its reply cut to the first token, the second masked out."""

    def check_finished(self, request, response_choice, current_turn):
        return current_turn >= 2

    def step(self, request, response_choice, current_turn):
        ids = response_choice.token_ids[:2]
        nxt = self.continue_turn(
            request, response_choice, " so", response_token_ids=ids, response_loss_mask=[1, 0]
        )
        return {"infer_request": nxt, "rollout_logprobs": response_choice.logprobs[:1]}


def test_continue_turn_takes_the_turns_ids_and_mask(chat):
    requests = make_requests(chat, 1)
    rollout = FakeRollout(chat)
    out = run_multi_turn(requests, [rollout.answer(requests[0])], Cut(chat, tool), rollout, CFG)[0]
    so = chat.encode(" so")
    eos = chat.stop_token_ids[0]
    assert out.response_token_ids == [[31, 40] + so + [32, 40, eos]]
    assert out.response_loss_mask == [[1, 0] + [0] * len(so) + [1, 1, 1]]
    assert out.to_trajectory().rollout_logprobs == LOGPROBS[:1] + LOGPROBS
    with pytest.raises(
        ValueError, match="request 0: response_loss_mask has 1 entries but response_token_ids has 2"
    ):
        Cut(chat, tool).continue_turn(
            requests[0], rollout.answer(requests[0]), response_token_ids=[1, 2], response_loss_mask=[1]
        )


class Observing(ToolScheduler):
    """An async before_first_turn that puts an environment's first observation into the prompt."""

    async def before_first_turn(self, requests):
        await asyncio.sleep(0)
        return [
            MultiTurnRequest.from_messages(
                self.chat, r.messages + [{"role": "user", "content": f"observation {r.index}"}], index=r.index
            )
            for r in requests
        ]


def test_before_first_turn_rewrites_the_requests_before_turn_one(chat):
    from interlens_mcore.rollout.multiturn import prepare_requests, prepare_requests_async

    scheduler = Observing(chat, tool)
    requests = prepare_requests(scheduler, make_requests(chat, 2))
    assert [r.messages[-1]["content"] for r in requests] == ["observation 0", "observation 1"]
    rollout = FakeRollout(chat)
    outs = run_multi_turn(
        requests, [rollout.answer(r) for r in requests], scheduler, rollout, CFG, max_turns=1
    )
    assert "observation 1" in chat.tokenizer.decode(outs[1].to_trajectory().token_ids)
    # the default hook returns the requests as they are
    plain = make_requests(chat, 1)
    assert prepare_requests(ToolScheduler(chat, tool), plain) == plain

    class Dropping(ToolScheduler):
        def before_first_turn(self, requests):
            return requests[1:]

    with pytest.raises(
        ValueError, match=r"Dropping.before_first_turn returned requests \[1\]; expected one per"
    ):
        prepare_requests(Dropping(chat, tool), make_requests(chat, 2))

    async def inside_a_loop():
        with pytest.raises(RuntimeError, match="use `await prepare_requests_async"):
            prepare_requests(scheduler, plain)
        return await prepare_requests_async(scheduler, plain)

    assert asyncio.run(inside_a_loop())[0].messages[-1]["content"] == "observation 0"


@pytest.mark.parametrize(
    "train, trained_turns", [("all", [1, 2, 3]), ("last", [3]), ([True, False, True], [1, 3])]
)
def test_train_turns_choose_the_trained_rounds(chat, train, trained_turns):
    requests = make_requests(chat, 1)
    rollout = FakeRollout(chat)
    first = [rollout.answer(r) for r in requests]
    out = run_multi_turn(
        requests, first, ToolScheduler(chat, tool), rollout, CFG, max_turns=3, train_turns=train
    )[0]
    traj = out.to_trajectory()
    eos = chat.stop_token_ids[0]
    assert [t for t, m in zip(traj.token_ids, traj.loss_mask) if m] == [
        x for t in trained_turns for x in (30 + t, 40, eos)
    ]
    assert traj.rollout_logprobs == LOGPROBS * len(trained_turns) and len(traj.turns) == len(trained_turns)
    assert out.to_trajectory(train_turns="all").num_trained_tokens == 9  # chosen per call, too
    with pytest.raises(ValueError, match="train_turns has 2 entries for 3 turns"):
        out.to_trajectory(train_turns=[True, False])


def test_run_multi_turn_async_inside_an_event_loop(chat):
    from interlens_mcore.rollout.multiturn import run_multi_turn_async

    requests = make_requests(chat, 2)
    rollout = FakeRollout(chat)
    first = [rollout.answer(r) for r in requests]

    async def main():
        outs = await run_multi_turn_async(
            requests, first, ToolScheduler(chat, tool), rollout, CFG, max_turns=2
        )
        with pytest.raises(RuntimeError, match="use `await run_multi_turn_async"):
            run_multi_turn(requests, first, ToolScheduler(chat, tool), rollout, CFG, max_turns=2)
        return outs

    assert [o.num_turns for o in asyncio.run(main())] == [2, 2]


def test_a_request_that_outgrows_the_context_ends_alone(tiny, chat):
    model, tokenizer = tiny
    rollout = EngineRollout(HFEngine(model, tokenizer, name="small", max_context=48), chat, seed=1)
    requests = make_requests(chat, 2)
    requests.append(
        MultiTurnRequest.from_messages(chat, [{"role": "user", "content": "word " * 60}], index=2)
    )
    first = rollout(requests, CFG)  # on main the engine raised for the whole batch here
    outs = run_multi_turn(requests, first, KeepGoing(chat, tool), rollout, CFG, max_turns=8)
    for out in outs[:2]:  # they grow by a tool message and 6 sampled tokens a turn
        traj = out.to_trajectory()
        assert out.status is Status.TRUNCATED and 1 < out.num_turns < 8
        # every sampled token was sampled inside the context; what follows is context (mask 0)
        assert max(t.end for t in traj.turns if t.end > t.start) <= 48 and traj.logprobs_complete
        assert traj.num_trained_tokens == sum(map(sum, out.response_loss_mask)) > 6
    too_long = outs[2]  # no room for a single token: ends at once, nothing sampled
    assert too_long.status is Status.TRUNCATED and too_long.num_turns == 1
    assert too_long.response_token_ids == [[]] and too_long.to_trajectory().num_trained_tokens == 0


@pytest.mark.parametrize(
    ("tool_says", "max_new"),
    [("a long tool output " * 6, 8), ("ok", 8), ("ok", 40)],  # the last prompt outgrew the context
)
def test_a_truncated_trajectory_holds_only_what_the_engine_saw(chat, tool_says, max_new):
    from support.fakes import Endless, Recording

    spy = Recording(Endless(name="small", max_context=60))
    rollout = EngineRollout(spy, chat, seed=1)
    cfg = SamplingParams(max_new_tokens=max_new)
    requests = [MultiTurnRequest.from_messages(chat, [{"role": "user", "content": "hi"}], index=0)]
    first = rollout(requests, cfg)
    out = run_multi_turn(
        requests, first, KeepGoing(chat, lambda text: tool_says), rollout, cfg, max_turns=20
    )[0]
    assert out.status is Status.TRUNCATED
    traj = out.to_trajectory()
    last = [call for call in spy.calls if call][-1][0]  # the engine's last row
    # on main the trajectory went on with what the last prompt gained (94, 69, 61 tokens)
    assert traj.token_ids[: len(last.prompt_ids)] == list(last.prompt_ids)
    assert len(traj.token_ids) == len(last.prompt_ids) + last.max_new_tokens <= 60
    assert traj.token_ids[-last.max_new_tokens :] == [7] * last.max_new_tokens  # what it sampled
    assert traj.num_trained_tokens == sum(map(sum, out.response_loss_mask)) and traj.logprobs_complete
    # a first prompt the context cannot hold: the engine saw nothing, the trajectory is empty
    huge = MultiTurnRequest.from_messages(chat, [{"role": "user", "content": "word " * 80}], index=1)
    alone = run_multi_turn([huge], rollout([huge], cfg), KeepGoing(chat, tool), rollout, cfg, max_turns=2)[0]
    assert alone.status is Status.TRUNCATED and alone.to_trajectory().token_ids == []
