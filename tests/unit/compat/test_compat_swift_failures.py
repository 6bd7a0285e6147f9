"""An ms-swift scheduler that raises for one request, through compat.swift on the tiny model: with
on_sample_error="skip" that request ends FAILED with its cause and the others run to their end;
with "raise" (the default) the scheduler's own exception ends the rollout, as before."""

from __future__ import annotations

import pytest

from interlens_mcore.compat.swift import MultiTurnScheduler, rollout_trajectories, run
from interlens_mcore.engines.base import SamplingParams
from interlens_mcore.engines.hf import HFEngine
from interlens_mcore.types import Status

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=3)


class RefusesOne(MultiTurnScheduler):
    """Three turns for every request; `step` raises for the row whose `bad` is set."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= 3

    def step(self, infer_request, response_choice, current_turn):
        if infer_request.data_dict["bad"]:
            raise KeyError("solution")
        infer_request.messages.append({"role": "user", "content": "again"})
        return {"infer_request": infer_request, "rollout_infos": {"reward": 1.0}}


def _rows():
    return [{"messages": [{"role": "user", "content": f"q {i}"}], "bad": i == 1} for i in range(3)]


def test_skip_fails_only_the_raising_request(tiny):
    engine = HFEngine(*tiny)
    outs = run(_rows(), RefusesOne(), engine, tiny[1], SAMPLING, seed=2, on_sample_error="skip")
    assert [o.status for o in outs] == [Status.STOPPED, Status.FAILED, Status.STOPPED]
    assert outs[0].num_turns == outs[2].num_turns == 3  # the others ran to their end
    trajectories = rollout_trajectories(
        RefusesOne(), _rows(), num_generations=1, engine=engine, tokenizer=tiny[1], sampling=SAMPLING,
        seed=2, on_sample_error="skip",
    )  # fmt: skip
    reasons = [t.infos.stop_reason for t in trajectories]
    assert reasons == [None, "scheduler: KeyError: 'solution'", None]
    assert trajectories[1].status is Status.FAILED


def test_raise_keeps_the_schedulers_own_exception(tiny):
    with pytest.raises(KeyError, match="solution") as info:
        run(_rows(), RefusesOne(), HFEngine(*tiny), tiny[1], SAMPLING, seed=2)
    assert "RefusesOne.step for request" in "\n".join(info.value.__notes__)
