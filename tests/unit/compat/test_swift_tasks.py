"""`SwiftTaskSource` (compat/swift/tasks.py): a scheduler's held-out rows report `eval/reward`
and `eval/success_rate` with its interval, as every task source does."""

from __future__ import annotations

from support.fakes import Says

from interlens_mcore.compat.swift import MultiTurnScheduler, SwiftTaskSource
from interlens_mcore.distributed import ParallelGroups
from interlens_mcore.grpo.rewards import WeightedRewards, environment_reward
from interlens_mcore.rollout.rollouter import RolloutConfig, Rollouter
from trainers.report.record import evaluation_figures


class Tips(MultiTurnScheduler):
    """One turn and no reward of its own, as ms-swift's MathTipsScheduler."""

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        return {"done": True}


def solved(completions, solution, **kwargs):
    return [float(s in c[-1]["content"]) for c, s in zip(completions, solution)]  # chat: message lists


def test_held_out_rows_of_a_scheduler_report_reward_and_success(tiny):
    _, tok = tiny
    says = Says(tok.encode("4", add_special_tokens=False) + [tok.eos_token_id])
    rollouter = Rollouter(
        engine=says, tokenizer=tok, groups=ParallelGroups(rank=0, world_size=1), config=RolloutConfig()
    )
    rows = [
        {"messages": [{"role": "user", "content": f"{a} + 2?"}], "solution": str(a + 2)} for a in (2, 3, 4)
    ]
    source = SwiftTaskSource(Tips(max_turns=1), rows, eval_dataset=rows)
    rollout = source.evaluate(rollouter, source.eval_rows(3, seed=0), step=0)
    from interlens_mcore.rewards import adapt

    # the scheduler sets no reward: the reward function is the reward, with the task's own left on
    rewards = WeightedRewards([environment_reward, adapt(solved, what="--reward solved")])
    totals, _ = rewards.score(rollout.trajectories, rollout.rows, step=0)
    for t, r in zip(rollout.trajectories, totals, strict=True):  # as the trainer's score() does
        t.reward = r
        t.infos.success = source.success_of(t)
    figures = evaluation_figures(rollout)
    # the engine says 4 every time: only 2 + 2 is solved
    assert figures["eval/reward"] == figures["eval/success_rate"] == 1 / 3
    assert figures["eval/success_n"] == 3
    assert 0.0 < figures["eval/success_low"] < 1 / 3 < figures["eval/success_high"] < 1.0
