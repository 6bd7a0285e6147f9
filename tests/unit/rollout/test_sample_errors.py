"""One sample's failure under `on_sample_error`: "skip" ends that sample FAILED with its cause and the
others carry on; "raise" fails the rollout as before; a failure that is no sample's (the engine)
fails it either way. Then `rollout_advantages` leaves FAILED samples out of every group's baseline."""

from __future__ import annotations

import pytest
import torch
from support.fakes import Endless

from interlens_mcore import Conversation, Environment, MaxTurns, Policy, SamplingParams, Status, co_step
from interlens_mcore.chat import ChatFormat
from interlens_mcore.engines.hf import HFEngine
from interlens_mcore.grpo.rewards import environment_reward
from interlens_mcore.rollout.multiturn import (
    EngineRollout,
    MultiTurnError,
    MultiTurnRequest,
    MultiTurnValueError,
    ToolScheduler,
    run_multi_turn,
)
from interlens_mcore.rollout.rollouter import RolloutConfig, describe, rollout_advantages
from interlens_mcore.rollout.vote import RolloutError
from interlens_mcore.types import Trajectory, TrajectoryInfo

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=3)


class Picky(Environment):
    """Answers every turn, but raises for the conversation named `bad`; its reward reads what a
    finished conversation has."""

    name = "env"

    def __init__(self, bad: str):
        self.bad = bad

    def respond(self, conv):
        if conv.id == self.bad:
            raise KeyError("solution")
        return "go on"

    def reward(self, conv):
        return float(conv.stop_reason == "MaxTurns")


def _lineups(tok, n: int, bad: str) -> list[Conversation]:
    pol = Policy("agent", Endless(), tok, SamplingParams(max_new_tokens=2))
    return [Conversation([pol, Picky(bad)], run_until=MaxTurns(4), id=f"c{i}") for i in range(n)]


def test_co_step_skip_fails_only_the_raising_conversation(tiny):
    convs = _lineups(tiny[1], 3, bad="c1")
    co_step(convs, on_sample_error="skip")  # nothing raised
    ok, bad, ok2 = convs
    assert bad.status is Status.FAILED and bad.stop_reason == "environment: KeyError: 'solution'"
    assert ok.status is ok2.status is Status.STOPPED and ok.turns_taken == ok2.turns_taken == 4
    t = bad.trajectories()[0]
    assert t.status is Status.FAILED and t.infos.stop_reason == "environment: KeyError: 'solution'"
    # the rollouter's record: a failed conversation's environments give it no reward (scored 0)
    good = ok.trajectories()[0]
    describe(t, bad)
    describe(good, ok)
    assert t.infos.env_reward is None and environment_reward([t], [None]) == [0.0]
    assert good.infos.env_reward == 1.0


def test_co_step_raise_fails_the_rollout_as_before(tiny):
    convs = _lineups(tiny[1], 3, bad="c1")
    with pytest.raises(RolloutError, match="rank 0: KeyError: 'solution' \\[conversation c1\\]"):
        co_step(convs)  # the default: raise
    assert convs[1].status is Status.FAILED
    assert convs[0].status is Status.RUNNING  # cut short by the failure, as before


def test_co_step_skip_still_fails_on_an_engine_failure(tiny):
    class Broken(Endless):
        def generate(self, requests):
            raise RuntimeError("engine fell over")

    pol = Policy("agent", Broken(), tiny[1], SamplingParams(max_new_tokens=2))
    convs = [Conversation([pol, Picky("none")], run_until=MaxTurns(2), id=f"c{i}") for i in range(2)]
    with pytest.raises(RuntimeError, match="engine fell over"):
        co_step(convs, on_sample_error="skip")


def test_co_step_refuses_an_unknown_on_sample_error(tiny):
    with pytest.raises(ValueError, match=r"co_step: on_sample_error must be one of \('skip', 'raise'\)"):
        co_step(_lineups(tiny[1], 1, bad="none"), on_sample_error="ignore")


class Exploding(ToolScheduler):
    """A tool scheduler that runs every request to its turn cap; its step raises for request `bad`
    at turn 2."""

    def __init__(self, chat, bad: int):
        super().__init__(chat, lambda text: "result")
        self.bad = bad

    def check_finished(self, request, response_choice, current_turn):
        return False

    def step(self, request, response_choice, current_turn):
        if request.index == self.bad and current_turn == 2:
            raise ValueError("the tool server said no")
        return super().step(request, response_choice, current_turn)


def _multi_turn(tiny, on_sample_error: str, bad: int = 1):
    chat = ChatFormat(tiny[1])
    requests = [
        MultiTurnRequest.from_messages(chat, [{"role": "user", "content": f"q {i}"}], index=i)
        for i in range(3)
    ]
    rollout = EngineRollout(HFEngine(*tiny), chat, seed=3)
    first = rollout(requests, SAMPLING)
    return run_multi_turn(
        requests, first, Exploding(chat, bad), rollout, SAMPLING, max_turns=3, on_sample_error=on_sample_error
    )


def test_run_multi_turn_skip_fails_only_the_raising_request(tiny):
    outs = _multi_turn(tiny, "skip")
    assert [o.status for o in outs] == [Status.MAX_TURNS, Status.FAILED, Status.MAX_TURNS]
    failed = outs[1]
    # its turns up to the one whose step raised: that turn is not recorded
    assert failed.error == "scheduler: ValueError: the tool server said no" and failed.num_turns == 1
    t = failed.to_trajectory()
    assert t.status is Status.FAILED and t.infos.stop_reason == failed.error
    assert all(o.num_turns == 3 and o.to_trajectory().infos.stop_reason is None for o in (outs[0], outs[2]))


def test_run_multi_turn_raise_fails_the_rollout(tiny):
    with pytest.raises(MultiTurnError, match="the tool server said no") as info:
        _multi_turn(tiny, "raise")
    assert [o.status for o in info.value.outputs] == [Status.RUNNING, Status.FAILED, Status.RUNNING]


def test_run_multi_turn_skip_still_fails_on_bad_engine_answers(tiny):
    chat = ChatFormat(tiny[1])
    requests = [MultiTurnRequest.from_messages(chat, [{"role": "user", "content": "q"}], index=0)]
    rollout = EngineRollout(HFEngine(*tiny), chat)
    first = rollout(requests, SAMPLING)
    first[0].logprobs = [float("nan")] * len(first[0].token_ids)  # rollout_fn's fault, not the request's
    with pytest.raises(MultiTurnValueError, match="rollout_fn logprobs must be finite"):
        run_multi_turn(requests, first, Exploding(chat, 9), rollout, SAMPLING, on_sample_error="skip")


# -- FAILED samples out of the loss -----------------------------------------------------------------


def _trajectory(group: int, reward: float, status: Status = Status.STOPPED) -> Trajectory:
    reason = "scheduler: ValueError: x" if status is Status.FAILED else None
    return Trajectory(
        token_ids=[1, 2, 3],
        rollout_logprobs=None,
        loss_mask=[0, 1, 1],
        group=group,
        status=status,
        reward=reward,
        infos=TrajectoryInfo(stop_reason=reason),
    )


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_failed_samples_leave_the_loss_and_the_baseline(leave_one_out):
    config = RolloutConfig(num_generations=3, leave_one_out=leave_one_out, scale_by_std=False)
    rewards = [1.0, 0.0, 5.0, 2.0, 0.0, 0.0]
    statuses = [Status.STOPPED, Status.STOPPED, Status.FAILED, Status.STOPPED, Status.FAILED, Status.FAILED]
    with_failed = [_trajectory(i // 3, r, s) for i, (r, s) in enumerate(zip(rewards, statuses, strict=True))]
    adv, keep = rollout_advantages(with_failed, config)
    # group 0 as if its failed sample never ran; group 1: one sample left
    alone, _ = rollout_advantages([_trajectory(0, 1.0), _trajectory(0, 0.0)], config)
    assert keep.tolist() == [True, True, False, not leave_one_out, False, False]
    assert torch.allclose(adv[:2], alone) and adv[2] == 0
    assert adv[3] == 0  # its group's baseline is itself (or, leave-one-out, it has none: left out)
