"""Reward functions: the one extension point for scoring trajectories.

A `RewardFn` is called once per step with this rank's trajectories and, for each, the row it
came from; it returns one float per trajectory. Each trajectory carries what scoring needs in
`infos` (a `TrajectoryInfo`):

- `infos.env_reward`: the environments' own reward for the trajectory's seat (lineups:
  the sum of `Environment.reward_for(conv, seat)`; schedulers: `rollout_infos[reward_key]`);
- `infos.completion`: the text of the seat's last message; `infos.messages`: the
  conversation as `{"role", "name", "content"}` dicts, as this seat saw it;
- `infos.extra`: what the environments or the scheduler reported under their own keys.

The environment's reward is the default `RewardFn`. Several functions combine with weights
(as TRL's `reward_funcs` / `reward_weights`); each is logged apart as `reward/<name>`::

    def brevity(trajectories, rows):
        return [1.0 if len(t.infos.completion) < 20 else 0.0 for t in trajectories]

    rewards = WeightedRewards([environment_reward, brevity], weights=[1.0, 0.5])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real
from typing import Any, Protocol

from ..types import Status, Trajectory


class RewardFn(Protocol):
    """`fn(trajectories, rows) -> one float per trajectory` (rows[i] is trajectories[i]'s row).

    The rows are the task source's own objects, whatever their type (so `Any`: a function that
    annotates them with its task's row type still fits).
    """

    def __call__(self, trajectories: Sequence[Trajectory], rows: Sequence[Any]) -> Sequence[float]: ...


class RewardError(ValueError):
    """A reward function returned something that is not one finite number per trajectory."""


def reward_name(fn: object) -> str:
    return getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__


def environment_reward(trajectories: Sequence[Trajectory], rows: Sequence[object]) -> list[float]:
    """The environments' own reward for each trajectory's seat (`infos.env_reward`).

    A trajectory a step time limit ended may never have been scored: it gets 0 here (the
    trainer then applies `on_timeout`); so does a FAILED one (it leaves the loss).
    """
    out = []
    for i, t in enumerate(trajectories):
        value = t.infos.env_reward
        if value is None and t.status not in (Status.TIMEOUT, Status.FAILED):
            raise RewardError(
                f"trajectory {i} ({t.infos.conversation or '?'}, seat {t.participant!r}) has no "
                "environment reward: its environment's reward() returned None, or its scheduler set "
                "no reward in rollout_infos; give the task a reward function (--reward MODULE:FN)"
            )
        out.append(0.0 if value is None else float(value))
    return out


environment_reward.name = "env"  # type: ignore[attr-defined]


def checked(fn: object, returned: object, trajectories: Sequence[Trajectory]) -> list[float]:
    """`returned` as one finite float per trajectory, or a `RewardError` naming `fn` and the sample."""
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
    out = []
    for i, (v, t) in enumerate(zip(values, trajectories)):
        if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(float(v)):
            where = f"{t.infos.conversation or '?'}, seat {t.participant!r}"
            raise RewardError(
                f"reward function {name!r} returned {v!r} for trajectory {i} ({where}), "
                "expected a finite number"
            )
        out.append(float(v))
    return out


class WeightedRewards:
    """A weighted sum of reward functions; `components` keeps each one's values for logging."""

    def __init__(self, fns: Sequence[RewardFn], weights: Sequence[float] | None = None):
        if not fns:
            raise ValueError("WeightedRewards needs at least one reward function")
        weights = [1.0] * len(fns) if weights is None else list(weights)
        if len(weights) != len(fns):
            raise ValueError(f"{len(weights)} reward weights for {len(fns)} reward functions")
        names = [reward_name(f) for f in fns]
        if len(set(names)) != len(names):
            raise ValueError(f"reward functions need distinct names, got {names}")
        self.fns, self.weights, self.names = list(fns), [float(w) for w in weights], names

    def __call__(self, trajectories: Sequence[Trajectory], rows: Sequence[object]) -> list[float]:
        return self.score(trajectories, rows)[0]

    def score(
        self, trajectories: Sequence[Trajectory], rows: Sequence[object]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """(weighted totals, each function's own values by name)."""
        parts = {n: checked(f, f(trajectories, rows), trajectories) for n, f in zip(self.names, self.fns)}
        totals = [
            sum(w * parts[n][i] for n, w in zip(self.names, self.weights)) for i in range(len(trajectories))
        ]
        return totals, parts
