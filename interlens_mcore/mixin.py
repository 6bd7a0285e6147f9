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

Rows are `Task`s (see `envs.guess.GuessNumberTask`); a task lays out its own lineup and asks
the trainer for a policy per seat it wants played (`seat_policy(name)`), so one task class
serves single-policy games, self-play (every seat the trained policy) and games against fixed
opponents. Each trainable seat gives its own trajectory from its own view, its own reward and
its own advantage group (per seat and prompt). Override `build_conversation` for another
lineup, `scheduler` for the scheduler path, `compute_rewards` for other rewards.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import torch

from .advantages import group_advantages
from .batch import LAYOUTS, TrainingBatch, build_batch
from .conversation import Conversation, Environment, Participant, Policy
from .costep import co_step
from .engine import SamplingParams
from .limits import check_time_limit
from .multiturn import EngineRollout, MultiTurnRequest, MultiTurnScheduler, run_multi_turn
from .sampling import mix_seed
from .stop import MaxTurns
from .trajectory import Message, Status, Trajectory

TIMEOUT_POLICIES = ("zero", "drop")
_EVAL_SALT = 0x6576616C  # folded into evaluation seeds, so they never repeat a training step's


class Task(Protocol):
    """One row of a step: an opening transcript, a lineup, and a turn cap.

    `lineup(seat)` returns the participants in speaking order; `seat(name)` is the trainer's
    policy for a seat (trained, or frozen when the trainer says so), so the task decides
    which seats a policy plays and which an environment or fixed opponent takes.
    """

    max_turns: int

    def prompt(self) -> list[Message]: ...

    def lineup(self, seat: Callable[[str], Policy]) -> list[Participant]: ...


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
    step_timeout_s: float | None = None  # time limit of one environment / tool / scheduler step
    on_timeout: str = "zero"  # a timed-out sample scores 0 ("zero") or leaves the batch ("drop")

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError(f"RolloutConfig.num_generations must be >= 1, got {self.num_generations}")
        if self.micro_batch_size < 0:
            raise ValueError(f"RolloutConfig.micro_batch_size must be >= 0, got {self.micro_batch_size}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"RolloutConfig.layout must be one of {LAYOUTS}, got {self.layout!r}")
        check_time_limit(self.step_timeout_s, "RolloutConfig.step_timeout_s")
        if self.on_timeout not in TIMEOUT_POLICIES:
            raise ValueError(
                f"RolloutConfig.on_timeout must be one of {TIMEOUT_POLICIES}, got {self.on_timeout!r}"
            )
        _ = self.sampling  # SamplingParams validates temperature and max_new_tokens

    @property
    def sampling(self) -> SamplingParams:
        """The sampling settings of every policy turn."""
        return SamplingParams(temperature=self.temperature, max_new_tokens=self.max_new_tokens)


@dataclass
class Rollout:
    """One step's rollouts on this rank."""

    trajectories: list[Trajectory]  # [N] with reward set, in (row, generation, seat) order
    advantages: torch.Tensor  # [N] float32
    keep: torch.Tensor  # [N] bool, False for dropped zero-variance groups and dropped timeouts
    conversations: list[Conversation] = field(default_factory=list)  # empty on the scheduler path

    @property
    def rewards(self) -> torch.Tensor:
        return torch.tensor([t.reward for t in self.trajectories], dtype=torch.float32)  # [N]

    @property
    def timeouts(self) -> int:
        """Samples whose conversation a step time limit ended (scored or dropped per config)."""
        return sum(t.status is Status.TIMEOUT for t in self.trajectories)

    def seat_rewards(self) -> dict[str, list[float]]:
        """Rewards per trained seat (participant name), in trajectory order."""
        out: dict[str, list[float]] = {}
        for t in self.trajectories:
            out.setdefault(t.participant, []).append(float(t.reward))
        return out


class RolloutMixin:
    """Rollout, reward, advantages and batches for a GRPO trainer (see the module docstring)."""

    engine: Any
    tokenizer: Any
    groups: Any  # parallel.ParallelGroups
    rollout_config: RolloutConfig

    # -- overridable pieces -------------------------------------------------------------------
    def policy(self) -> Policy:
        """The trained participant of single-policy tasks (the seat named "policy")."""
        return self.seat_policy("policy")

    def seat_policy(self, name: str) -> Policy:
        """Who plays seat `name` in training lineups: by default the trained policy (self-play).

        Override to put a frozen or different policy in some seats (a `Policy` with another
        engine and `trainable=False`), and pass its engine in `extra_engines`.
        """
        return self.trained_policy(name)

    def trained_policy(self, name: str) -> Policy:
        """The trained policy in seat `name`; every seat shares the engine.

        Built once per seat name (a policy's chat format renders probes on creation).
        """
        if name not in self._trained_seats:
            self._trained_seats[name] = Policy(
                name=name, engine=self.engine, tokenizer=self.tokenizer, sampling=self.rollout_config.sampling
            )
        return self._trained_seats[name]

    @cached_property
    def _trained_seats(self) -> dict[str, Policy]:
        return {}

    def extra_engines(self) -> list[Any]:
        """Engines besides `self.engine` that lineups use (e.g. a frozen opponent's)."""
        return []

    def build_conversation(self, row: Task, *, id: str, seed: int, group: int) -> Conversation:
        """The lineup for one sample of `row`, as the task lays it out."""
        return Conversation(
            row.lineup(self.seat_policy),
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

        Lineup path: the sum of the environments' rewards for the trajectory's seat
        (`Environment.reward_for(conv, seat)`). Scheduler path (no conversations): the
        `reward` the scheduler put in `rollout_infos`.
        """
        if not conversations:
            # a request its step time limit ended may never have reached the code that scores it;
            # it scores 0 (or leaves the batch: `RolloutConfig.on_timeout`)
            late = {i for i, t in enumerate(trajectories) if t.status is Status.TIMEOUT}
            missing = [i for i, t in enumerate(trajectories) if "reward" not in t.infos and i not in late]
            if missing:
                raise ValueError(
                    f"trajectory {missing[0]} has no rollout_infos['reward']: set it from the "
                    "scheduler's on_turn_end / step, or override compute_rewards"
                )
            return [float(t.infos.get("reward", 0.0)) for t in trajectories]
        by_id = {c.id: c for c in conversations}
        out = []
        for t in trajectories:
            conv = by_id[t.infos["conversation"]]
            scores = [p.reward_for(conv, t.participant) for p in conv.lineup if isinstance(p, Environment)]
            out.append(float(sum(s for s in scores if s is not None)))
        return out

    # -- the step ----------------------------------------------------------------------------
    def generate_rollouts(self, rows: Sequence[Any], step: int) -> Rollout:
        """Run, score and advantage this rank's conversations for `rows` (collective)."""
        scheduler = self.scheduler()
        if scheduler is not None:
            return self._scheduler_rollouts(scheduler, rows, step)
        convs = self.make_conversations(rows, step)
        trajectories = self._co_step(convs, mix_seed(self.rollout_config.seed, step))
        for t, r in zip(trajectories, self.compute_rewards(convs, trajectories), strict=True):
            t.reward = r
        return self._with_advantages(trajectories, convs)

    def _co_step(self, convs: list[Conversation], group_seed: int) -> list[Trajectory]:
        co_step(
            convs,
            turns=None,
            max_batch_size=self.rollout_config.max_batch_size,
            group_seed=group_seed,
            gather_fn=self.groups.gather_fn(),
            rank=self.groups.rollout_rank,
            engines=[self.engine, *self.extra_engines()],
            step_timeout_s=self.rollout_config.step_timeout_s,
        )
        return [t for c in convs for t in c.trajectories()]

    def evaluate(self, rows: Sequence[Any], step: int) -> dict[str, list[float]]:
        """Play `rows` once each without training (collective); this rank's scores per key.

        Keys: `reward/<seat>` for every trained seat and, for games whose referee writes
        `conv.infos['outcome']` (seat -> 1 win, 1/2 tie, 0 loss), `win_rate/<seat>`. The
        caller averages over ranks. Seeds differ from every training step's.
        """
        # the trained policy takes every seat the task gives a policy, also one a frozen
        # opponent holds in training: evaluation measures what training changes
        convs = [
            Conversation(
                row.lineup(self.trained_policy),
                prompt=row.prompt(),
                run_until=MaxTurns(row.max_turns),
                id=f"eval{step}-r{self.groups.rank}-p{i}",
                seed=mix_seed(self.rollout_config.seed, step, self.groups.rank, i, _EVAL_SALT),
                group=i,
            )
            for i, row in enumerate(rows)
        ]
        trajectories = self._co_step(convs, mix_seed(self.rollout_config.seed, step, _EVAL_SALT))
        by_id = {c.id: c for c in convs}
        out: dict[str, list[float]] = {}
        for t, r in zip(trajectories, self.compute_rewards(convs, trajectories), strict=True):
            out.setdefault(f"reward/{t.participant}", []).append(r)
            outcome = by_id[t.infos["conversation"]].infos.get("outcome")
            if outcome is not None and t.participant in outcome:
                out.setdefault(f"win_rate/{t.participant}", []).append(float(outcome[t.participant]))
        return out

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
        sampling = cfg.sampling
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
            step_timeout_s=cfg.step_timeout_s,
        )
        trajectories = [o.to_trajectory(group=o.request.data["group"]) for o in outputs]
        for t, r in zip(trajectories, self.compute_rewards([], trajectories), strict=True):
            t.reward = r
        return self._with_advantages(trajectories, [])

    def _with_advantages(self, trajectories: list[Trajectory], convs: list[Conversation]) -> Rollout:
        """Advantages per (prompt, seat) group; timed-out samples scored 0 or left out."""
        cfg = self.rollout_config
        timed_out = [t.status is Status.TIMEOUT for t in trajectories]
        if cfg.on_timeout == "zero":
            for t, late in zip(trajectories, timed_out, strict=True):
                t.reward = 0.0 if late else t.reward
        # a dropped sample must not move its group's baseline: advantages over the others only
        seats = sorted({t.participant for t in trajectories})
        key = [t.group * len(seats) + seats.index(t.participant) for t in trajectories]  # (prompt, seat)
        used = [i for i, late in enumerate(timed_out) if not (late and cfg.on_timeout == "drop")]
        if cfg.leave_one_out:  # a sample its group's drops left alone has no baseline: it leaves too
            full, left = Counter(key), Counter(key[i] for i in used)
            used = [i for i in used if left[key[i]] > 1 or full[key[i]] == 1]
        adv = torch.zeros(len(trajectories))
        keep = torch.zeros(len(trajectories), dtype=torch.bool)
        if used:
            groups = [key[i] for i in used]
            a, k = group_advantages(
                [trajectories[i].reward for i in used],
                groups,
                scale_by_std=cfg.scale_by_std,
                leave_one_out=cfg.leave_one_out,
                drop_zero_variance=cfg.drop_zero_variance,
            )
            adv[used], keep[used] = a, k
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
