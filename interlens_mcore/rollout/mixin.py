"""`RolloutMixin`: this package's rollouts in a GRPO trainer that is not ours, in one call per step.

A trainer mixes it in and sets four attributes::

    class MyTrainer(RolloutMixin, MyBaseTrainer):
        def __init__(self, ...):
            self.engine = HFEngine(model, tokenizer)          # anything with Engine's protocol
            self.tokenizer = tokenizer
            self.groups = distributed.build_groups(rollout="data_parallel")
            self.rollout_config = RolloutConfig(num_generations=8)

    rollout = trainer.generate_rollouts(rows, step)            # rewards and advantages set
    for batch in trainer.training_batches(rollout): ...

Rows are `Task`s (`interlens_mcore.tasks`), or message lists when `scheduler()` returns a
`MultiTurnScheduler`. Rewards come from `compute_rewards(trajectories, rows)`: by default the
environments' own (`rewards.environment_reward`); override it or set `reward_fns`. Seats named
in `frozen_seats` (and, for evaluation rows that ask, `eval_frozen_seats`) are played by
`frozen_engine()`. Our own trainer (`trainers.GRPOTrainer`) composes the same pieces
(`Rollouter`, reward functions, `rollout_estimate`, `micro_batches`) without this class.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from .. import distributed
from ..chat import Tokenizer
from ..engines.base import Engine
from ..grpo.batch import Layout, pad_id
from ..grpo.rewards import RewardFn, WeightedRewards, environment_reward
from ..types import Trajectory
from .multiturn import MultiTurnScheduler
from .rollouter import (
    Rollout,
    RolloutConfig,
    Rollouter,
    RolloutGroup,
    micro_batches,
    rollout_estimate,
    whole_batch_advantages,
)

__all__ = ["Rollout", "RolloutConfig", "RolloutMixin"]


class RolloutMixin:
    """Rollout, reward, advantages and micro-batches for a GRPO trainer (see the module docstring)."""

    engine: Engine
    tokenizer: Tokenizer
    groups: RolloutGroup  # distributed.ParallelGroups
    rollout_config: RolloutConfig
    reward_fns: Sequence[RewardFn] = (environment_reward,)
    frozen_seats: tuple[str, ...] = ()
    eval_frozen_seats: tuple[str, ...] = ()  # seats evaluation rows may give the frozen copy
    layout: Layout = "packed"  # of the training batches: "packed" (THD) or "padded" [B, T]
    pad_to_multiple: int = 1

    def scheduler(self) -> MultiTurnScheduler | None:
        """A scheduler selects the `run_multi_turn` path; rows must then be message lists."""
        return None

    def frozen_engine(self) -> Engine:
        raise NotImplementedError(f"{type(self).__name__} sets frozen_seats but has no frozen_engine()")

    def compute_rewards(self, trajectories: Sequence[Trajectory], rows: Sequence[object]) -> list[float]:
        """One reward per trajectory: `reward_fns` summed (rows[i] is trajectories[i]'s row)."""
        raise_errors = self.rollout_config.on_sample_error == "raise"
        return WeightedRewards(list(self.reward_fns), raise_errors=raise_errors)(trajectories, rows)

    @cached_property
    def rollouter(self) -> Rollouter:
        return Rollouter(
            engine=self.engine,
            tokenizer=self.tokenizer,
            groups=self.groups,
            config=self.rollout_config,
            frozen_seats=self.frozen_seats,
            eval_frozen_seats=self.eval_frozen_seats,
            frozen_engine=self.frozen_engine if self.frozen_seats or self.eval_frozen_seats else None,
        )

    def policy(self):
        """The trained participant of single-policy tasks (the seat named "policy")."""
        return self.rollouter.trained("policy")

    def generate_rollouts(self, rows: Sequence[object], step: int) -> Rollout:
        """Run, score and advantage this rank's samples of `rows` (collective)."""
        rollout = self.rollouter.run(rows, step, self.scheduler())
        for t, r in zip(
            rollout.trajectories, self.compute_rewards(rollout.trajectories, rollout.rows), strict=True
        ):
            t.reward = r
        est = rollout_estimate(rollout.trajectories, self.rollout_config)
        rollout.advantages, rollout.keep, rollout.batch_step = est.advantages, est.keep, est.batch
        # an estimator's batch statistics (REINFORCE++, --scale-rewards batch) over the world's samples
        whole_batch_advantages(rollout, lambda x: distributed.all_reduce(x, "sum"))
        return rollout

    def evaluate(self, rows: Sequence[object], step: int) -> Rollout:
        """Each row once, the trained policy in every policy seat, rewards set (collective)."""
        rollout = self.rollouter.evaluate(rows, step)
        for t, r in zip(
            rollout.trajectories, self.compute_rewards(rollout.trajectories, rollout.rows), strict=True
        ):
            t.reward = r
        return rollout

    def training_batches(self, rollout: Rollout):
        """Micro-batches of `RolloutConfig.micro_batch_size` kept trajectories (None: an empty one)."""
        return micro_batches(
            rollout,
            micro_batch_size=self.rollout_config.micro_batch_size,
            layout=self.layout,
            pad_to_multiple=self.pad_to_multiple,
            pad_id=pad_id(self.tokenizer),
        )
