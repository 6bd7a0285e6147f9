"""Three reward-function conventions, told apart by the signature (`inspect.signature`).

- a class: an ms-swift ORM (`class MyORM(ORM): def __call__(self, completions, **kwargs)`).
  It is instantiated with no arguments, as ms-swift does, and called with the completions as
  text and keywords: every dataset column of the row (`solution`, ...), `messages` (the whole
  transcript: the row's opening messages, then the conversation), `response_token_ids` and
  `trainer_state`.
- a function or callable object with a `**kwargs` parameter, or a parameter named `prompts`,
  `completions` or `completion_ids`: TRL's `fn(prompts, completions, completion_ids, **kwargs)`.
  Keywords: every dataset column of the row (reasoning-gym: `question`, `answer`, `metadata`),
  `trainer_state` (`global_step`, `max_steps`), `log_extra(column, values)` (one value per
  sample, kept in each sample's `infos.extra[column]`) and `log_metric(name, value)` (logged
  as `reward_metric/<name>`, the mean over the step's calls and ranks). `prompts` are the rows'
  opening messages and `completions` what followed, as text or message lists by TRL's rule
  (`inputs.is_text`).

Every convention reads the same `inputs.RewardInputs` of each sample.
- anything else taking two positional parameters: ours, `fn(trajectories, rows)`.

An `async def` function (anything returning an awaitable) is awaited. Every convention may
return `None` for a sample: "not applicable" (see `grpo.rewards`).
"""

from __future__ import annotations

import asyncio
import enum
import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

from ..grpo.rewards import RewardFn, StatefulReward, reward_name
from ..types import Trajectory
from . import inputs

Values = Sequence[float | None]  # what a function returns, checked by WeightedRewards
TRL_NAMES = frozenset({"prompts", "completions", "completion_ids"})


class Convention(str, enum.Enum):
    OURS = "ours"  # fn(trajectories, rows)
    TRL = "trl"  # fn(prompts, completions, completion_ids, **columns)
    ORM = "orm"  # ms-swift: class with __call__(self, completions, **kwargs)


def convention_of(obj: object, *, what: str) -> Convention:
    """Which convention `obj` follows (module docstring); ValueError naming `what` if none."""
    if inspect.isclass(obj):
        return Convention.ORM
    if not callable(obj):
        raise ValueError(f"{what}: {type(obj).__name__} is not callable")
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: only ours can be called blind
        return Convention.OURS
    if any(p.kind is p.VAR_KEYWORD for p in params) or TRL_NAMES & {p.name for p in params}:
        return Convention.TRL
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params):
        return Convention.OURS
    names = ", ".join(p.name for p in params) or "none"
    raise ValueError(
        f"{what}: {reward_name(obj)} takes ({names}); expected fn(trajectories, rows), TRL's "
        "fn(prompts, completions, completion_ids, **kwargs) or an ms-swift ORM class"
    )


def adapt(obj: object, *, what: str, name: str | None = None) -> RewardFn:
    """`obj` as our `RewardFn`, named `name` (default: its own name) for `reward/<name>`."""
    kind = convention_of(obj, what=what)
    if kind is Convention.OURS:
        if name is None:
            return obj  # type: ignore[return-value]  # checked callable with two positionals
        return Renamed(obj, name)  # type: ignore[arg-type]
    if kind is Convention.TRL:
        return TRLReward(obj, name or reward_name(obj))  # type: ignore[arg-type]
    try:
        instance = obj()  # type: ignore[operator]  # ms-swift instantiates ORMs with no arguments
    except Exception as exc:
        raise ValueError(
            f"{what}: the ORM class {reward_name(obj)} cannot be built with no arguments "
            f"({type(exc).__name__}: {exc})"
        ) from None
    if not callable(instance):
        raise ValueError(
            f"{what}: the ORM class {reward_name(obj)} has no __call__(self, completions, **kwargs)"
        )
    return ORMReward(instance, name or reward_name(obj))


def awaited(value: object) -> object:
    """`value`, or what it resolves to when a coroutine function returned it."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> object:
        return await value

    return asyncio.run(wait())


def accepted(fn: Callable[..., object], kwargs: dict[str, object]) -> dict[str, object]:
    """`kwargs`, or those `fn` names when it takes no `**kwargs` (TRL would fail on the rest)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


class Renamed:
    """One of ours under another name (a registry name)."""

    def __init__(self, fn: RewardFn, name: str):
        self.fn, self.name = fn, name

    def __call__(self, trajectories: Sequence[Trajectory], rows: Sequence[Any]) -> Sequence[float | None]:
        return cast(Values, awaited(self.fn(trajectories, rows)))


class TRLReward(StatefulReward):
    """A TRL reward function called with TRL's arguments (module docstring).

    `per_sample`: more keywords, one list over the trajectories each (TRL's `environments`,
    the environment instance of each sample, from `tools.trl_env`).
    """

    def __init__(
        self,
        fn: Callable[..., object],
        name: str,
        per_sample: Callable[[Sequence[Trajectory]], dict[str, list[object]]] | None = None,
    ):
        super().__init__()
        self.fn, self.name, self.per_sample = fn, name, per_sample

    def __call__(self, trajectories: Sequence[Trajectory], rows: Sequence[Any]) -> Sequence[float | None]:
        given = [inputs.reward_inputs(t, row) for t, row in zip(trajectories, rows, strict=True)]
        extra: dict[str, list[object]] = {}
        kwargs = {
            "prompts": [x.prompt_text if x.text else x.prompt for x in given],
            "completions": [x.completion_text if x.text else x.completion for x in given],
            "completion_ids": [x.completion_ids for x in given],
            **inputs.batch_columns(given),
            "trainer_state": self.state,
            "log_extra": lambda column, values: extra.setdefault(column, []).extend(values),
            "log_metric": lambda key, value: self.metrics.setdefault(key, []).append(float(value)),
            **(self.per_sample(trajectories) if self.per_sample is not None else {}),
        }
        out = awaited(self.fn(**accepted(self.fn, kwargs)))
        for column, values in extra.items():
            for t, v in zip(trajectories, values):
                t.infos.extra[column] = v
        return cast(Values, out)  # checked by WeightedRewards


class ORMReward(StatefulReward):
    """An ms-swift ORM instance called as ms-swift calls it (module docstring)."""

    def __init__(self, orm: Callable[..., object], name: str):
        super().__init__()
        self.orm, self.name = orm, name

    def __call__(self, trajectories: Sequence[Trajectory], rows: Sequence[Any]) -> Sequence[float | None]:
        given = [inputs.reward_inputs(t, row) for t, row in zip(trajectories, rows, strict=True)]
        kwargs = {
            **inputs.batch_columns(given),
            "messages": [x.transcript for x in given],
            "response_token_ids": [x.completion_ids for x in given],
            "trainer_state": self.state,
        }
        completions = [x.completion_text for x in given]
        return cast(Values, awaited(self.orm(completions, **accepted(self.orm, kwargs))))
