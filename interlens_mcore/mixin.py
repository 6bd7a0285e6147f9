"""`RolloutMixin`: what a GRPO trainer needs from this package, in one call per step.

Given a step's rows (prompts or environment configs), it repeats each row `num_generations`
times, runs the colocated multi-turn rollout of this rank's conversations on the rollout
group (a lineup through `co_step`, or a `MultiTurnScheduler` through `run_multi_turn`),
scores them, computes group advantages (a group's samples all live on this rank, so they are
never normalised apart) and cuts the trajectories into `TrainingBatch` micro-batches.

A trainer that is not ours mixes it in and sets four attributes::

    class MyTrainer(RolloutMixin, MyBaseTrainer):
        def __init__(self, ...):
            self.engine = HFEngine(model, tokenizer)          # anything with Engine's protocol
            self.tokenizer = tokenizer
            self.groups = parallel.build_groups(rollout="data_parallel")
            self.rollout_config = RolloutConfig(num_generations=8)

    rollout = trainer.generate_rollouts(rows, step)
    for batch in trainer.training_batches(rollout): ...

Rows are `Task`s (see `envs.guess.GuessNumberTask`); override `build_conversation` for
another lineup, `scheduler` for the scheduler path, `compute_rewards` for other rewards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .advantages import group_advantages
from .batch import LAYOUTS, TrainingBatch, build_batch
from .conversation import Conversation, Environment, Policy
from .costep import co_step
from .engine import SamplingParams
from .multiturn import EngineRollout, MultiTurnRequest, MultiTurnScheduler, run_multi_turn
from .sampling import mix_seed
from .stop import MaxTurns
from .trajectory import Message, Trajectory


class Task(Protocol):
    """One row of a step: an opening transcript, an environment, and a turn cap."""

    max_turns: int

    def prompt(self) -> list[Message]: ...

    def environment(self) -> Environment: ...


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How rollouts are sampled, scored and cut into micro-batches."""

    num_generations: int = 8  # samples per row: one advantage group
    temperature: float = 1.0
    max_new_tokens: int = 8  # per policy turn
    max_batch_size: int | None = None  # rows per engine call (None: all of a round's rows)
    scale_by_std: bool = True
    leave_one_out: bool = False
    drop_zero_variance: bool = False
    micro_batch_size: int = 0  # trajectories per micro-batch; 0: all of this rank's
    layout: str = "packed"
    pad_to_multiple: int = 1  # e.g. TP x CP for sequence parallelism
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError(f"RolloutConfig.num_generations must be >= 1, got {self.num_generations}")
        if self.micro_batch_size < 0:
            raise ValueError(f"RolloutConfig.micro_batch_size must be >= 0, got {self.micro_batch_size}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"RolloutConfig.layout must be one of {LAYOUTS}, got {self.layout!r}")
        SamplingParams(temperature=self.temperature, max_new_tokens=self.max_new_tokens)  # validates


@dataclass
class Rollout:
    """One step's rollouts on this rank."""

    trajectories: list[Trajectory]  # [N] with reward set, in (row, generation) order
    advantages: torch.Tensor  # [N] float32
    keep: torch.Tensor  # [N] bool, False for dropped zero-variance groups
    conversations: list[Conversation] = field(default_factory=list)  # empty on the scheduler path

    @property
    def rewards(self) -> torch.Tensor:
        return torch.tensor([t.reward for t in self.trajectories], dtype=torch.float32)  # [N]


class RolloutMixin:
    """Rollout, reward, advantages and batches for a GRPO trainer (see the module docstring)."""

    engine: Any
    tokenizer: Any
    groups: Any  # parallel.ParallelGroups
    rollout_config: RolloutConfig

    # -- overridable pieces -------------------------------------------------------------------
    def policy(self) -> Policy:
        """The trained participant; built once (its chat format renders probes on creation)."""
        if getattr(self, "_policy", None) is None:
            cfg = self.rollout_config
            sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
            self._policy = Policy(
                name="policy", engine=self.engine, tokenizer=self.tokenizer, sampling=sampling
            )
        return self._policy

    def build_conversation(self, row: Task, *, id: str, seed: int, group: int) -> Conversation:
        """The lineup for one sample of `row`: the policy, then the row's environment."""
        return Conversation(
            [self.policy(), row.environment()],
            prompt=row.prompt(),
            run_until=MaxTurns(row.max_turns),
            id=id,
            seed=seed,
            group=group,
        )

    def scheduler(self) -> MultiTurnScheduler | None:
        """A scheduler selects the `run_multi_turn` path; rows must then be message lists."""
        return None

    def compute_rewards(
        self, conversations: Sequence[Conversation], trajectories: Sequence[Trajectory]
    ) -> list[float]:
        """One reward per trajectory.

        Lineup path: the sum of the environments' rewards of its conversation. Scheduler path
        (no conversations): the `reward` the scheduler put in `rollout_infos`.
        """
        if not conversations:
            missing = [i for i, t in enumerate(trajectories) if "reward" not in t.infos]
            if missing:
                raise ValueError(
                    f"trajectory {missing[0]} has no rollout_infos['reward']: set it from the "
                    "scheduler's on_turn_end / step, or override compute_rewards"
                )
            return [float(t.infos["reward"]) for t in trajectories]
        by_id = {c.id: c for c in conversations}
        out = []
        for t in trajectories:
            conv = by_id[t.infos["conversation"]]
            scores = [p.reward(conv) for p in conv.lineup if isinstance(p, Environment)]
            out.append(float(sum(s for s in scores if s is not None)))
        return out

    # -- the step ----------------------------------------------------------------------------
    def generate_rollouts(self, rows: Sequence[Any], step: int) -> Rollout:
        """Run, score and advantage this rank's conversations for `rows` (collective)."""
        scheduler = self.scheduler()
        if scheduler is not None:
            return self._scheduler_rollouts(scheduler, rows, step)
        convs = self.make_conversations(rows, step)
        co_step(
            convs,
            turns=None,
            max_batch_size=self.rollout_config.max_batch_size,
            group_seed=mix_seed(self.rollout_config.seed, step),
            gather_fn=self.groups.gather_fn(),
            rank=self.groups.rollout_rank,
            engines=[self.engine],
        )
        trajectories = [t for c in convs for t in c.trajectories()]
        for t, r in zip(trajectories, self.compute_rewards(convs, trajectories), strict=True):
            t.reward = r
        return self._with_advantages(trajectories, convs)

    def make_conversations(self, rows: Sequence[Any], step: int) -> list[Conversation]:
        """`num_generations` conversations per row; ids and seeds name the rank, step and row."""
        rank, convs = self.groups.rank, []
        for i, row in enumerate(rows):
            for k in range(self.rollout_config.num_generations):
                cid = f"s{step}-r{rank}-p{i}-g{k}"
                seed = mix_seed(self.rollout_config.seed, step, rank, i, k)
                convs.append(self.build_conversation(row, id=cid, seed=seed, group=i))
        return convs

    def _scheduler_rollouts(self, scheduler: MultiTurnScheduler, rows: Sequence[Any], step: int) -> Rollout:
        cfg = self.rollout_config
        chat = self.policy().chat
        requests, n = [], cfg.num_generations
        for i, messages in enumerate(rows):
            for k in range(n):
                index = (self.groups.rank * len(rows) + i) * n + k
                requests.append(
                    MultiTurnRequest.from_messages(chat, messages, index=index, data={"group": i})
                )
        sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
        rollout_fn = EngineRollout(self.engine, chat, seed=mix_seed(cfg.seed, step))
        first = rollout_fn(requests, sampling)  # collective: every rank has rows every step
        outputs = run_multi_turn(
            requests,
            first,
            scheduler,
            rollout_fn,
            sampling,
            gather_fn=self.groups.gather_fn(),
            rank=self.groups.rollout_rank,
        )
        trajectories = [o.to_trajectory(group=o.request.data["group"]) for o in outputs]
        for t, r in zip(trajectories, self.compute_rewards([], trajectories), strict=True):
            t.reward = r
        return self._with_advantages(trajectories, [])

    def _with_advantages(self, trajectories: list[Trajectory], convs: list[Conversation]) -> Rollout:
        cfg = self.rollout_config
        adv, keep = group_advantages(
            [t.reward for t in trajectories],
            [t.group for t in trajectories],
            scale_by_std=cfg.scale_by_std,
            leave_one_out=cfg.leave_one_out,
            drop_zero_variance=cfg.drop_zero_variance,
        )
        return Rollout(trajectories=trajectories, advantages=adv, keep=keep, conversations=convs)

    def training_batches(self, rollout: Rollout) -> list[TrainingBatch]:
        """Micro-batches of the kept trajectories; trajectories with no trained token are skipped.

        The number of micro-batches depends only on the config and the number of rows, so every
        DP rank makes the same number of forward/backward calls (an empty one carries no rows:
        the caller still joins the collectives with a zero-token batch of its own).
        """
        cfg = self.rollout_config
        pairs = [
            (t, float(a))
            for t, a, k in zip(rollout.trajectories, rollout.advantages, rollout.keep, strict=True)
            if k and t.num_trained_tokens > 0
        ]
        size = cfg.micro_batch_size or max(1, len(rollout.trajectories))
        count = math.ceil(len(rollout.trajectories) / size)
        chunks = [pairs[i * size : (i + 1) * size] for i in range(count)]
        return [
            build_batch(
                [t for t, _ in c],
                [a for _, a in c],
                layout=cfg.layout,
                pad_to_multiple=cfg.pad_to_multiple,
                pad_id=self.engine_pad_id(),
            )
            if c
            else None
            for c in chunks
        ]

    def engine_pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)
