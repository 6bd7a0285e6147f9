"""Reward functions: the one extension point for scoring trajectories.

A `RewardFn` is called once per step with this rank's trajectories and, for each, the row it
came from; it returns one float per trajectory. Each trajectory carries what scoring needs in
`infos` (a `TrajectoryInfo`):

- `infos.env_reward`: the environments' own reward for the trajectory's seat (lineups:
  the sum of `Environment.reward_for(conv, seat)`; schedulers: `rollout_infos[reward_key]`);
- `infos.completion`: the text of the seat's last message; `infos.messages`: the whole
  conversation as `{"role", "name", "content"}` dicts, as this seat saw it, the row's opening
  messages first (`infos.opening` of them; `rewards.inputs.reward_inputs` reads them all);
- `infos.extra`: what the environments or the scheduler reported under their own keys.

The environment's reward is the default `RewardFn`. Beside other functions it gives None
("not applicable") to the samples whose task set no reward of its own, so reward functions given
to a task without a reward (a scheduler that sets none) are the reward; alone, a sample without
one is a `NoEnvironmentReward`. Several functions combine with weights
(as TRL's `reward_funcs` / `reward_weights`); each is logged apart as `reward/<name>`::

    def brevity(trajectories, rows):
        return [1.0 if len(t.infos.completion) < 20 else 0.0 for t in trajectories]

    rewards = WeightedRewards([environment_reward, brevity], weights=[1.0, 0.5])

TRL reward functions and ms-swift ORMs run through adapters to this convention
(`interlens_mcore.rewards`); this module is what they all reduce to.

A value may be `None`: "not applicable to this sample" (TRL's rule). The weighted sum skips it
(TRL's `nansum`), and `reward/<name>` is the mean over the non-None values. A sample for which
every function returned None is unscorable: its total is 0.0 and `infos.unscored` is set, which
keeps it out of its group's baseline and out of the loss (TRL 1.16 sets such a sample's reward
to NaN, excludes it from the baseline and gives it advantage 0).

One bad sample does not end the run: when a function raises for the batch, the samples are
scored one at a time, those that raise become FAILED (`infos.stop_reason` = `"reward <name>:
ExcType: message"`) and the others keep their values; functions are called only on the samples
not FAILED (earlier in the rollout or by an earlier function), and a FAILED sample scores 0.0
with no part. `raise_errors=True` (`--on-sample-error raise`) lets the first exception through.
A returned value that is not a number, or a wrong count, is a `RewardError` at once: that is a
bug in the function, not a bad sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any, Protocol

from ..rollout.outcome import failure_reason
from ..types import Status, Trajectory


class RewardFn(Protocol):
    """`fn(trajectories, rows) -> one float (or None) per trajectory` (rows[i] is trajectories[i]'s row).

    The rows are the task source's own objects, whatever their type (so `Any`: a function that
    annotates them with its task's row type still fits).
    """

    def __call__(self, trajectories: Sequence[Trajectory], rows: Sequence[Any]) -> Sequence[float | None]: ...


class RewardError(ValueError):
    """A reward function returned something that is not one finite number (or None) per trajectory."""


ASK_FOR_A_REWARD = "give the task a reward function (--reward MODULE:FN)"


class NoEnvironmentReward(RewardError):
    """The task's own reward was asked for and the task gives none; `hint` says what to pass."""

    def __init__(self, sample: str, hint: str = ASK_FOR_A_REWARD):
        self.sample = sample
        super().__init__(
            f"{sample} has no environment reward: its environment's reward() returned None, or its "
            f"scheduler set no reward in rollout_infos; {hint}"
        )


@dataclass
class TrainerState:
    """What TRL passes reward functions as `trainer_state` (the fields they read)."""

    global_step: int = 0
    max_steps: int | None = None


class StatefulReward:
    """A reward function that reads the trainer's state (`WeightedRewards` shares its own with
    it) and may log scalar metrics of its own (`take_metrics`)."""

    def __init__(self) -> None:
        self.state = TrainerState()
        self.metrics: dict[str, list[float]] = {}

    def take_metrics(self) -> dict[str, list[float]]:
        """The values logged since the last call, by metric name (then forgotten)."""
        out, self.metrics = self.metrics, {}
        return out


def reward_name(fn: object) -> str:
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__


def environment_reward(trajectories: Sequence[Trajectory], rows: Sequence[object]) -> list[float]:
    """The environments' own reward for each trajectory's seat (`infos.env_reward`).

    A trajectory a step time limit ended may never have been scored, nor one that failed: they
    get 0 here (the trainer then applies `on_timeout`, and leaves FAILED samples out).
    """
    out = []
    for i, t in enumerate(trajectories):
        value = t.infos.env_reward
        if value is None and t.status not in (Status.TIMEOUT, Status.FAILED):
            where = f"{t.infos.conversation or '?'}, seat {t.participant!r}"
            raise NoEnvironmentReward(f"trajectory {i} ({where})")
        out.append(0.0 if value is None or t.status is Status.FAILED else float(value))
    return out


environment_reward.name = "env"  # type: ignore[attr-defined]


def checked(fn: object, returned: object, trajectories: Sequence[Trajectory]) -> list[float | None]:
    """`returned` as one finite float (or None) each, else a `RewardError` naming `fn` and the sample."""
    name = reward_name(fn)
    tolist = getattr(returned, "tolist", None)  # a tensor or numpy array
    if tolist is not None:
        values = list(tolist())
    elif isinstance(returned, Sequence) and not isinstance(returned, (str, bytes)):
        values = list(returned)
    else:
        raise RewardError(
            f"reward function {name!r} returned {type(returned).__name__}, expected a list of floats"
        )
    if len(values) != len(trajectories):
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {len(trajectories)} trajectories"
        )
    out: list[float | None] = []
    for i, (v, t) in enumerate(zip(values, trajectories)):
        if v is None:
            out.append(None)
            continue
        if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(float(v)):
            where = f"{t.infos.conversation or '?'}, seat {t.participant!r}"
            raise RewardError(
                f"reward function {name!r} returned {v!r} for trajectory {i} ({where}), "
                "expected a finite number or None"
            )
        out.append(float(v))
    return out


def mark_failed(t: Trajectory, name: str, exc: BaseException) -> None:
    """The shared contract: FAILED, with the cause starting with what failed."""
    t.status = Status.FAILED
    t.infos.stop_reason = failure_reason(f"reward {name}", exc)


def collective(fn: object) -> bool:
    """A reward function whose call is collective over the rollout group (`collective = True`,
    e.g. `rewards.judge.Judge`): every rank calls it each step, with no samples too."""
    return getattr(fn, "collective", False) is True


class WeightedRewards:
    """A weighted sum of reward functions; `components` keeps each one's values for logging."""

    def __init__(
        self, fns: Sequence[RewardFn], weights: Sequence[float] | None = None, *, raise_errors: bool = False
    ):
        if not fns:
            raise ValueError("WeightedRewards needs at least one reward function")
        weights = [1.0] * len(fns) if weights is None else list(weights)
        if len(weights) != len(fns):
            raise ValueError(f"{len(weights)} reward weights for {len(fns)} reward functions")
        names = [reward_name(f) for f in fns]
        if len(set(names)) != len(names):
            raise ValueError(f"reward functions need distinct names, got {names}")
        self.fns, self.weights, self.names = list(fns), [float(w) for w in weights], names
        self.raise_errors = raise_errors
        self.state = TrainerState()
        for f in self.fns:
            if isinstance(f, StatefulReward):
                f.state = self.state

    def __call__(self, trajectories: Sequence[Trajectory], rows: Sequence[object]) -> list[float]:
        return self.score(trajectories, rows)[0]

    def take_metrics(self) -> dict[str, list[float]]:
        """What the functions logged (TRL's `log_metric`) since the last call, by metric name."""
        out: dict[str, list[float]] = {}
        for f in self.fns:
            if isinstance(f, StatefulReward):
                for key, values in f.take_metrics().items():
                    out.setdefault(key, []).extend(values)
        return out

    def score(
        self, trajectories: Sequence[Trajectory], rows: Sequence[object], *, step: int | None = None
    ) -> tuple[list[float], dict[str, list[float | None]]]:
        """(weighted totals, each function's own values by name: None where it did not apply).

        `step`: the trainer's step, what TRL functions read as `trainer_state.global_step`.
        """
        if step is not None:
            self.state.global_step = step
        n = len(trajectories)
        parts: dict[str, list[float | None]] = {name: [None] * n for name in self.names}
        # collective functions first: a user function raising on one rank must not leave the
        # other ranks waiting in a collective one's round (the world check after the phase
        # reports the raise on every rank)
        order = sorted(zip(self.names, self.fns), key=lambda pair: not collective(pair[1]))
        for name, fn in order:
            live = [i for i, t in enumerate(trajectories) if t.status is not Status.FAILED]
            if not live and not collective(fn):
                continue  # a collective function (the judge) is called on every rank, even empty
            values = self.call(fn, name, [trajectories[i] for i in live], [rows[i] for i in live])
            for i, v in zip(live, values):
                parts[name][i] = v
        totals = []
        for i, t in enumerate(trajectories):
            if t.status is Status.FAILED:
                for name in self.names:
                    parts[name][i] = None
            given = [(w, parts[name][i]) for name, w in zip(self.names, self.weights)]
            present = [w * v for w, v in given if v is not None]
            t.infos.unscored = t.status is not Status.FAILED and not present
            totals.append(sum(present))
        return totals, parts

    def call(
        self, fn: RewardFn, name: str, trajectories: list[Trajectory], rows: list[object]
    ) -> list[float | None]:
        """`fn`'s checked values; a raising batch is retried sample by sample (module docstring)."""
        try:
            returned = fn(trajectories, rows)
        except NoEnvironmentReward:
            if len(self.fns) == 1:  # neither the task nor the user gives a reward
                raise
            # reward functions were given and the task has no reward of its own (a scheduler that
            # sets none, a dataset): the functions are the reward, as in TRL and ms-swift; the
            # task's own counts where it gave one
            return [t.infos.env_reward for t in trajectories]
        except RewardError:
            raise
        except Exception:
            if self.raise_errors or collective(fn):
                raise  # a collective function's retry would run a different number of rounds per rank
            return [self.one(fn, name, t, row) for t, row in zip(trajectories, rows)]
        return checked(fn, returned, trajectories)

    def one(self, fn: RewardFn, name: str, t: Trajectory, row: object) -> float | None:
        """`fn` on one sample: its value, or None with the sample FAILED when it raises."""
        try:
            returned = fn([t], [row])
        except RewardError:
            raise
        except Exception as exc:
            mark_failed(t, name, exc)
            return None
        return checked(fn, returned, [t])[0]
