"""RolloutMixin in a trainer that is not ours: an HF model, one process, no torch.distributed."""

from __future__ import annotations

import math

import torch
from support.fakes import ForeignTrainer

from interlens_mcore.rollout.conversation import Conversation, Scripted
from interlens_mcore.tasks.guess import GuessNumberTask, guess_tasks, reply_number
from interlens_mcore.types import Message


def test_groups_advantages_and_batches(tiny):
    trainer = ForeignTrainer(*tiny, num_generations=4, micro_batch_size=3)
    rows = guess_tasks(2, seed=1)
    rollout = trainer.generate_rollouts(rows, step=0)
    assert len(rollout.trajectories) == 8
    assert [t.group for t in rollout.trajectories] == [0] * 4 + [1] * 4
    # each group is centred on its own mean, never normalised with the other group
    assert rollout.advantages.view(2, 4).sum(dim=1).abs().max() < 1e-5
    for t in rollout.trajectories:
        assert 0.0 <= t.reward <= 1.0 and t.logprobs_complete
    batches = trainer.training_batches(rollout)
    assert [b.num_samples for b in batches] == [3, 3, 2]  # ceil(8 / 3) micro-batches
    assert sum(b.num_loss_tokens for b in batches) == sum(t.num_trained_tokens for t in rollout.trajectories)


def test_same_step_same_rollout(tiny):
    # seeds come from (seed, step, rank, row, sample): a resumed run replays the same samples
    a = ForeignTrainer(*tiny, num_generations=2).generate_rollouts(guess_tasks(2, seed=3), step=5)
    b = ForeignTrainer(*tiny, num_generations=2).generate_rollouts(guess_tasks(2, seed=3), step=5)
    assert [t.token_ids for t in a.trajectories] == [t.token_ids for t in b.trajectories]
    c = ForeignTrainer(*tiny, num_generations=2).generate_rollouts(guess_tasks(2, seed=3), step=6)
    assert [t.token_ids for t in a.trajectories] != [t.token_ids for t in c.trajectories]


def test_custom_reward_override(tiny):
    class Always(ForeignTrainer):
        def compute_rewards(self, trajectories, rows):
            return [float(i % 2) for i in range(len(trajectories))]

    rollout = Always(*tiny, num_generations=2).generate_rollouts(guess_tasks(1, seed=0), step=0)
    assert rollout.rewards.tolist() == [0.0, 1.0]
    # rewards 0 and 1 in one group: mean 0.5, unbiased std sqrt(0.5), so A = -+0.5 / 0.7071
    assert torch.allclose(rollout.advantages, torch.tensor([-0.7071, 0.7071]), atol=1e-3)


def test_guess_reward_shape():
    task = GuessNumberTask(secret=40, high=100, hints=False)
    env = task.environment()
    conv = Conversation([Scripted("policy", ["50", "4x"], role="assistant"), env], prompt=task.prompt())
    conv.start()
    for speaker in [conv.lineup[0], env, conv.lineup[0], env]:
        msg = speaker.respond(conv)
        conv.commit(speaker, Message(speaker=speaker.name, content=msg, role=speaker.role))
    assert [m.content for m in conv.messages] == ["50", "lower", "4x", "higher"]
    assert reply_number("4x") == 4
    # unsolved: "50" -> lower leaves [1, 49], "4x" -> higher leaves [5, 49], 45 of 100 numbers;
    # reward 0.3 x log(100 / 45) / log(100) = 0.052 (tests/test_guess_reward.py has the rest)
    assert abs(env.reward(conv) - 0.3 * math.log(100 / 45) / math.log(100)) < 1e-9


def test_scheduler_path(tiny):
    from interlens_mcore.rollout.multiturn import ToolScheduler

    class WithTool(ForeignTrainer):
        def scheduler(self):
            # a tool that answers every reply; two engine calls per request at most
            return ToolScheduler(self.policy().chat, tool=lambda text: "ok", max_turns=2)

        def compute_rewards(self, trajectories, rows):
            assert len(rows) == len(trajectories)
            return [float(len(t.turns)) / 2 for t in trajectories]

    trainer = WithTool(*tiny, num_generations=3, max_new_tokens=3)
    rows = [[{"role": "user", "content": "add 2 and 3"}], [{"role": "user", "content": "add 1 and 1"}]]
    rollout = trainer.generate_rollouts(rows, step=0)
    assert [t.group for t in rollout.trajectories] == [0, 0, 0, 1, 1, 1]
    assert all(1 <= len(t.turns) <= 2 and t.logprobs_complete for t in rollout.trajectories)
    assert rollout.rewards.tolist() == [len(t.turns) / 2 for t in rollout.trajectories]
    assert len(trainer.training_batches(rollout)) == 1


def test_scheduler_path_needs_a_reward(tiny):
    import pytest

    from interlens_mcore.rollout.multiturn import ToolScheduler

    class NoReward(ForeignTrainer):
        def scheduler(self):
            return ToolScheduler(self.policy().chat, tool=lambda text: "ok", max_turns=1)

    with pytest.raises(ValueError, match="its scheduler set no reward in rollout_infos"):
        NoReward(*tiny, num_generations=2).generate_rollouts([[{"role": "user", "content": "hi"}]], step=0)
