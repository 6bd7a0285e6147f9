"""`SwiftTaskSource`: dataset rows and an ms-swift scheduler, for the trainer.

Rows are dicts (dataset rows): `messages` opens the conversation, every other field reaches
the scheduler as `infer_request.data_dict` (`solution`, `env_config`, ...). A row without
`messages` needs a scheduler whose `on_trajectory_start` writes them (a gym scheduler's
reset does). The reward is `rollout_infos[reward_key]`: `reward` by default, `total_reward`
for gym schedulers.

    task = SwiftTaskSource.from_spec("my_plugin:MathTips", plugins=["my_plugin.py"],
                                     dataset=rows, max_turns=3)
    trajectories = task.rollout(rows, num_generations=8, engine=engine, tokenizer=tokenizer,
                                sampling=sampling, seed=step_seed, gather_fn=gather_fn, rank=rank)
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from ... import SamplingParams, Trajectory
from ...chat import Tokenizer
from ...engines.base import Engine
from ...rollout.outcome import OnSampleError
from ...rollout.rollouter import Rollout, Rollouter, RolloutPlan
from ...rollout.vote import GatherFn, local_gather
from ...tasks.base import TaskSource
from .driver import rollout_trajectories, run_requests, sample_requests
from .foreign import as_ours
from .plugins import build_scheduler, load_plugins, resolve_gym_env, resolve_scheduler
from .scheduler import MultiTurnScheduler
from .types import TrainTurns


class SwiftTaskSource(TaskSource):
    """A step's rows drawn from `dataset` by seed; one ms-swift scheduler plays them all."""

    name = "swift"

    def __init__(
        self,
        scheduler: MultiTurnScheduler | object,  # or one on ms-swift's own base classes
        dataset: Sequence[dict[str, object]],
        *,
        eval_dataset: Sequence[dict[str, object]] = (),
        reward_key: str = "reward",
        max_turns: int | None = None,
        train_turns: TrainTurns = "all",
        name: str | None = None,
        success_threshold: float = 1.0,
    ):
        ours = as_ours(scheduler, "SwiftTaskSource")
        for label, rows in (("dataset", dataset), ("eval_dataset", eval_dataset)):
            bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
            if bad is not None:
                raise ValueError(f"SwiftTaskSource {label}[{bad}] must be a dict row, got {rows[bad]!r}")
        if not dataset:
            raise ValueError("SwiftTaskSource needs a non-empty dataset")
        if train_turns not in get_args(TrainTurns):
            raise ValueError(f"train_turns must be one of {get_args(TrainTurns)}, got {train_turns!r}")
        self._scheduler, self.dataset, self.eval_dataset = ours, list(dataset), list(eval_dataset)
        self.reward_key, self.max_turns, self.train_turns = reward_key, max_turns, train_turns
        self.name = name or self.name
        # ms-swift schedulers report a reward, not whether a sample succeeded: as for a dataset
        # row, a sample succeeds when its reward reaches this (1.0: the usual right answer)
        self.success_threshold = success_threshold

    @classmethod
    def from_spec(
        cls,
        spec: str,
        *,
        dataset: Sequence[dict[str, object]],
        plugins: Sequence[str | Path] = (),
        max_turns: int | None = None,
        scheduler_kwargs: dict[str, Any] | None = None,  # the scheduler class's own keywords
        gym_env: str | None = None,
        **options: Any,  # SwiftTaskSource's keywords
    ) -> SwiftTaskSource:
        """`--external-plugins FILE.py ... --multi-turn-scheduler MODULE:CLASS` (or a registered name).

        `gym_env` (`--gym-env NAME`) names a registered environment; the scheduler gets it as
        ms-swift passes it, `gym_env=NAME`.
        """
        load_plugins(plugins)
        scheduler_cls = resolve_scheduler(spec)
        kwargs = dict(scheduler_kwargs or {})
        if gym_env is not None:
            resolve_gym_env(gym_env)
            kwargs["gym_env"] = gym_env
        scheduler = build_scheduler(scheduler_cls, max_turns=max_turns, **kwargs)
        return cls(scheduler, dataset, max_turns=max_turns, **options)

    def rows(self, n: int, *, seed: int) -> list[dict[str, object]]:
        """`n` rows, without repeats while the dataset has enough, a pure function of `seed`."""
        rng = random.Random(seed)
        size = len(self.dataset)
        picks = rng.sample(range(size), n) if n <= size else [rng.randrange(size) for _ in range(n)]
        return [copy.deepcopy(self.dataset[i]) for i in picks]

    def eval_rows(self, n: int, *, seed: int) -> list[dict[str, object]]:
        """The first `n` held-out rows (the same every evaluation)."""
        return [copy.deepcopy(r) for r in self.eval_dataset[:n]]

    def scheduler(self) -> MultiTurnScheduler:
        return self._scheduler

    def success_of(self, trajectory: Trajectory) -> float | None:
        """Whether the sample's reward reached `success_threshold` (a success set on the
        trajectory comes first): what `success_rate` and `eval/success_rate` count."""
        if trajectory.infos.success is not None:
            return trajectory.infos.success
        reward = trajectory.reward  # set by the trainer before it asks
        return None if reward is None else float(reward >= self.success_threshold)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "scheduler": type(self._scheduler).__name__,
            "reward_key": self.reward_key,
            "max_turns": self.max_turns,
            "train_turns": self.train_turns,
            "rows": len(self.dataset),
            "eval_rows": len(self.eval_dataset),
        }

    def run(self, rollouter: Rollouter, rows: Sequence[object], step: int) -> Rollout:
        """The trainer's rollout of `rows` through this scheduler (collective): the samples of
        `rollouter.plan`, as every rollout path expands rows."""
        return self._as_rollout(rollouter.plan(rows, step))

    def evaluate(self, rollouter: Rollouter, rows: Sequence[object], step: int) -> Rollout:
        return self._as_rollout(rollouter.plan(rows, step, evaluation=True))

    def _as_rollout(self, plan: RolloutPlan[object]) -> Rollout:
        outputs = run_requests(
            sample_requests(plan.samples),
            self._scheduler,
            plan.engine,
            plan.tokenizer,
            plan.sampling,
            max_turns=self.max_turns,
            seed=plan.group_seed,
            gather_fn=plan.gather_fn,
            rank=plan.rank,  # request indices and seeds are unique across every rank of the world
            step_timeout_s=plan.step_timeout_s,
            train_turns=self.train_turns,
            on_sample_error=plan.on_sample_error,
        )
        trajectories = [
            out.to_trajectory(group=s.group, reward_key=self.reward_key)
            for out, s in zip(outputs, plan.samples, strict=True)
        ]
        return Rollout(trajectories=trajectories, rows=[s.row for s in plan.samples])

    def rollout(
        self,
        rows: Sequence[dict[str, object]],
        *,
        num_generations: int,
        engine: Engine,
        tokenizer: Tokenizer,
        sampling: SamplingParams,
        seed: int,
        gather_fn: GatherFn = local_gather,
        rank: int = 0,
        step_timeout_s: float | None = None,
        on_sample_error: OnSampleError = "raise",
    ) -> list[Trajectory]:
        """This rank's trajectories for `rows` (collective), `infos["env_reward"]` from `reward_key`.

        `on_sample_error="skip"` ends a request whose hook or step raises FAILED, alone (as training does).
        """
        return rollout_trajectories(
            self._scheduler,
            rows,
            num_generations=num_generations,
            engine=engine,
            tokenizer=tokenizer,
            sampling=sampling,
            seed=seed,
            gather_fn=gather_fn,
            rank=rank,
            step_timeout_s=step_timeout_s,
            reward_key=self.reward_key,
            max_turns=self.max_turns,
            train_turns=self.train_turns,
            on_sample_error=on_sample_error,
        )
