"""Train a multi-turn task of this package with TRL's own `GRPOTrainer`, our rollouts inside.

    torchrun --nproc_per_node=2 launch/trl_grpo.py --model runs/tiny-qwen2 --task guess --max-steps 3

TRL owns the model, optimizer, loss and logging; `TRLRollouts` is its `rollout_func`: each
prompt of TRL's batch is played as a whole multi-turn conversation (guesses and the game's
replies) in lockstep rounds on the trainer's model, and TRL trains the policy's tokens only
(`env_mask`). On CPU (gloo) pass `--use-cpu`; the script never sets bf16.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence

from interlens_mcore.integrations.trl import TRLRollouts, env_reward
from interlens_mcore.rollout.rollouter import RolloutConfig
from interlens_mcore.tasks import TaskSource, resolve_task


def build_trainer(
    source: TaskSource,
    *,
    model: str,
    output_dir: str,
    max_steps: int = 3,
    num_generations: int = 2,
    batch_size: int = 2,
    max_new_tokens: int = 4,
    use_cpu: bool = False,
    reward_funcs: Sequence[Callable[..., list[float]]] = (env_reward,),
):
    """TRL's GRPOTrainer over `source`'s rows with `TRLRollouts` as its rollout_func."""
    from trl import GRPOConfig, GRPOTrainer

    rollouts = TRLRollouts(
        source,
        config=RolloutConfig(num_generations=1, max_new_tokens=max_new_tokens, on_sample_error="raise"),
    )
    args = GRPOConfig(
        output_dir=output_dir,
        max_steps=max_steps,
        num_generations=num_generations,
        per_device_train_batch_size=batch_size,
        max_completion_length=max_new_tokens,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=use_cpu,
        bf16=False,
        gradient_checkpointing=False,  # tiny models: recomputing activations only costs time
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=rollouts.dataset(64),
        rollout_func=rollouts,
    )


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model folder (or hub name)")
    p.add_argument("--task", default="guess", help="a task source: guess, reasoning_gym:ID, gym:ID, ...")
    p.add_argument("--task-args", default="{}", help="JSON object of the task source's options")
    p.add_argument("--output-dir", default="runs/trl-grpo")
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--num-generations", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2, help="rollouts per process and step")
    p.add_argument("--max-new-tokens", type=int, default=4, help="token cap of one policy turn")
    p.add_argument("--use-cpu", action="store_true")
    a = p.parse_args(argv)
    source = resolve_task(a.task, json.loads(a.task_args))
    trainer = build_trainer(
        source,
        model=a.model,
        output_dir=a.output_dir,
        max_steps=a.max_steps,
        num_generations=a.num_generations,
        batch_size=a.batch_size,
        max_new_tokens=a.max_new_tokens,
        use_cpu=a.use_cpu,
    )
    trainer.train()


if __name__ == "__main__":
    main()
