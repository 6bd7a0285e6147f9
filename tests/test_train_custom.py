"""A user's trainer: subclass a GRPO trainer, override the reward, train on 2 gloo ranks."""

from __future__ import annotations

from dist_utils import run_ranks


def _short_replies_reward(conversations, trajectories) -> list[float]:
    # 1 for a first policy reply of at most 3 sampled tokens, else 0: checkable from the trajectory
    first = [t.turns[0] for t in trajectories]
    return [1.0 if sum(t.loss_mask[s.start : s.end]) <= 3 else 0.0 for t, s in zip(trajectories, first)]


def _train_custom(rank, world_size, tiny_path, out):
    from transformers import AutoTokenizer

    from interlens_mcore import parallel
    from interlens_mcore.loss import LossConfig
    from interlens_mcore.mixin import RolloutConfig
    from trainers import MegatronGRPOTrainer, TrainerConfig

    class ShortReplies(MegatronGRPOTrainer):
        def compute_rewards(self, conversations, trajectories):
            return _short_replies_reward(conversations, trajectories)

    parallel.init_megatron(1)
    trainer = ShortReplies(
        model_path=tiny_path,
        config=TrainerConfig(steps=2, prompts_per_rank=2, output_dir=str(out)),
        rollout_config=RolloutConfig(num_generations=4, max_new_tokens=6),
        loss_config=LossConfig(is_mode="token_truncate"),
        groups=parallel.build_groups(rollout="model_parallel"),
        tokenizer=AutoTokenizer.from_pretrained(tiny_path),
    )
    rollout = trainer.generate_rollouts(trainer.rows_for_step(0), 0)
    expected = _short_replies_reward([], rollout.trajectories)
    got = [t.reward for t in rollout.trajectories]
    # groups of 4 are centred on their own mean: advantages sum to 0 within each group
    group_sums = rollout.advantages.view(-1, 4).sum(dim=1).abs().max().item()
    records = trainer.train()
    return got, expected, group_sums, [r["step"] for r in records]


def test_custom_reward_subclass(tmp_path, tiny_path):
    results = run_ranks(_train_custom, 2, str(tiny_path), str(tmp_path / "out"), timeout=240)
    for got, expected, group_sums, steps in results:
        assert got == expected and len(got) == 8
        assert group_sums < 1e-5
        assert steps == [0, 1]
    assert (tmp_path / "out" / "metrics.jsonl").is_file()
