"""Turn parsed options into configs, process groups and a trainer (shared by the launch scripts)."""

from __future__ import annotations

import math

from options import Options, UsageError, model_folder

from interlens_mcore import parallel
from interlens_mcore.envs import trained_seats
from interlens_mcore.loss import LossConfig
from interlens_mcore.mixin import RolloutConfig
from trainers import GRPOTrainer, TrainerConfig


def configs(opts: Options) -> tuple[TrainerConfig, RolloutConfig, LossConfig]:
    """The three keyword-only configs; their ValueErrors name the bad option."""
    try:
        trainer = TrainerConfig(
            steps=opts.steps,
            prompts_per_rank=opts.batch_size // opts.num_generations,
            lr=opts.lr,
            weight_decay=opts.weight_decay,
            grad_clip=opts.grad_clip,
            updates_per_rollout=opts.updates_per_rollout,
            save_every=opts.save_every,
            seed=opts.seed,
            output_dir=opts.output_dir,
            env=opts.env,
            opponent=opts.opponent,
            max_guesses=opts.max_guesses,
            eval_every=opts.eval_every,
        )
        rollout = RolloutConfig(
            num_generations=opts.num_generations,
            temperature=opts.temperature,
            max_new_tokens=opts.max_new_tokens,
            micro_batch_size=opts.micro_batch_size,
            scale_by_std=opts.scale_by_std,
            drop_zero_variance=opts.drop_zero_variance,
            layout="packed" if opts.backend == "megatron" else "padded",
            seed=opts.seed,
            step_timeout_s=opts.step_timeout_s,
            on_timeout=opts.on_timeout,
        )
        loss = LossConfig(
            epsilon=opts.epsilon,
            epsilon_high=opts.epsilon_high,
            dual_clip=opts.dual_clip,
            beta=opts.beta,
            kl_estimator=opts.kl_estimator,
            aggregation=opts.aggregation,
            is_mode=opts.is_mode,
            is_threshold=opts.is_threshold,
            bypass=opts.bypass,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return trainer, rollout, loss


def import_backend(opts: Options) -> None:
    """Import megatron-core or DeepSpeed once the options are known to be valid.

    Late because both print warnings on import, which must not reach the one-line error of a
    bad-input run.
    """
    import trainers

    getattr(trainers, "MegatronGRPOTrainer" if opts.backend == "megatron" else "DeepSpeedGRPOTrainer")


def build_trainer(opts: Options, run_info: dict) -> GRPOTrainer:
    """Collective: process groups, the model and the trainer for --backend."""
    from transformers import AutoTokenizer

    trainer_cfg, rollout_cfg, loss_cfg = configs(opts)
    path = model_folder(opts)
    tokenizer = AutoTokenizer.from_pretrained(path)
    common = dict(
        config=trainer_cfg,
        rollout_config=rollout_cfg,
        loss_config=loss_cfg,
        tokenizer=tokenizer,
        run_info=run_info,
    )
    if opts.backend == "megatron":
        from trainers import MegatronGRPOTrainer

        parallel.init_megatron(opts.tp)
        groups = parallel.build_groups(rollout="model_parallel")
        return MegatronGRPOTrainer(model_path=path, groups=groups, **common)
    from trainers import DeepSpeedGRPOTrainer, deepspeed_config

    rollout = "data_parallel" if opts.zero_stage == 3 else "model_parallel"
    groups = parallel.build_groups(rollout=rollout)
    # trajectories per rank: one per trained seat of each conversation
    per_rank = opts.batch_size * trained_seats(opts.env, opts.opponent)
    micro = math.ceil(per_rank / opts.micro_batch_size) if opts.micro_batch_size else 1
    ds = deepspeed_config(
        zero_stage=opts.zero_stage,
        lr=opts.lr,
        weight_decay=opts.weight_decay,
        grad_clip=opts.grad_clip,
        micro_batches=micro,
    )
    return DeepSpeedGRPOTrainer(model_path=path, ds_config=ds, groups=groups, **common)
