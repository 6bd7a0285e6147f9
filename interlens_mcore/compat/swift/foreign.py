"""Schedulers written on ms-swift's own base classes, driven here through their hooks.

ms-swift's `multi_turn.py` defines its own `RolloutScheduler` and `MultiTurnScheduler` (with a
`run()` loop that calls ms-swift's engine), then its schedulers on them. Loaded as a plugin
file with only its import lines changed, those classes are not subclasses of ours. A class is
recognised as ms-swift style by its hooks: it has `check_finished`, `step` and `on_turn_end`
(`is_swift_style`). `adapt` builds it as ms-swift does and wraps it in a `SwiftStyle`, a
`compat.swift.MultiTurnScheduler` whose hooks are the wrapped scheduler's, so the compat
driver runs it exactly as it runs ours; an instance the user built
(`MathTipsScheduler(max_turns=2)`) is wrapped the same way when it reaches `run` or
`SwiftTaskSource` (`as_ours`). Its own `run` / `async_infer` are never called: the
turns are this driver's (see docs/swift.md).
"""

from __future__ import annotations

import inspect
from typing import Any, cast

from ...chat import Tokenizer
from ...engines.base import Engine
from ...rollout.limits import maybe_await
from .scheduler import InferEngine, MultiTurnScheduler
from .types import ChatCompletionResponseChoice, RolloutInferRequest

HOOKS = ("check_finished", "step", "on_turn_end")


def _defines(cls: type, name: str) -> bool:
    # static lookup: ms-swift's RolloutScheduler.__getattr__ answers None for unknown names
    return callable(inspect.getattr_static(cls, name, None))


def is_swift_style(cls: object) -> bool:
    """A class with ms-swift's scheduler hooks (`check_finished`, `step`, `on_turn_end`)."""
    return isinstance(cls, type) and all(_defines(cls, h) for h in HOOKS)


class SwiftStyle(MultiTurnScheduler):
    """An ms-swift-style scheduler (`inner`) seen as ours: every hook is the inner one's."""

    def __init__(self, inner: Any):  # deliberately not the base's: its state is the inner one's
        self.inner = inner

    @property
    def max_turns(self) -> int | None:
        return self.inner.max_turns

    @max_turns.setter
    def max_turns(self, value: int | None) -> None:
        self.inner.max_turns = value

    @property
    def infer_engine(self) -> InferEngine | None:
        return self.inner.infer_engine

    @infer_engine.setter
    def infer_engine(self, value: InferEngine | None) -> None:
        self.inner.infer_engine = value

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.inner.tokenizer

    def bind(self, engine: Engine, tokenizer: Tokenizer) -> None:
        """Give the scheduler the tokenizer (ms-swift keeps it as `_tokenizer`), not the engine.

        ms-swift's colocate mode builds its schedulers with no `infer_engine` and the tokenizer
        passed; its `RolloutScheduler.__getattr__` forwards unknown names to a set engine and
        answers None where it has none (`getattr(self, "max_concurrent_envs", 4)` would be None).
        """
        if vars(self.inner).get("_tokenizer") is None:
            self.inner._tokenizer = tokenizer

    async def on_trajectory_start(self, requests: list[RolloutInferRequest]) -> None:
        if _defines(type(self.inner), "on_trajectory_start"):
            await maybe_await(self.inner.on_trajectory_start(requests))

    async def on_turn_end(
        self,
        infer_request: RolloutInferRequest,
        response_choice: ChatCompletionResponseChoice,
        current_turn: int,
    ) -> dict[str, Any]:
        # what it returned is checked by the bridge, as every scheduler's is
        return cast(
            dict[str, Any],
            await maybe_await(self.inner.on_turn_end(infer_request, response_choice, current_turn)),
        )

    async def on_trajectory_end(
        self, requests: list[RolloutInferRequest], error: BaseException | None = None
    ) -> None:
        if _defines(type(self.inner), "on_trajectory_end"):  # ms-swift's own schedulers have none
            await maybe_await(self.inner.on_trajectory_end(requests, error))

    def check_finished(
        self,
        infer_request: RolloutInferRequest,
        response_choice: ChatCompletionResponseChoice,
        current_turn: int,
    ) -> bool:
        return self.inner.check_finished(infer_request, response_choice, current_turn)

    def step(
        self,
        infer_request: RolloutInferRequest,
        response_choice: ChatCompletionResponseChoice,
        current_turn: int,
    ) -> dict[str, Any]:
        return self.inner.step(infer_request, response_choice, current_turn)


def adapt(cls: type, *, infer_engine: InferEngine | None, max_turns: int | None, **kwargs: Any) -> SwiftStyle:
    """`cls(infer_engine=..., max_turns=..., **kwargs)` as ms-swift builds it, wrapped."""
    return wrap(cls(infer_engine=infer_engine, max_turns=max_turns, **kwargs))


def wrap(inner: object) -> SwiftStyle:
    """An ms-swift-style scheduler already built, as ours; the wrapper's class carries the inner
    class's name, so errors and the start line name the user's class."""
    cls = type(inner)
    named = type(cls.__name__, (SwiftStyle,), {"__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return named(inner)


def as_ours(scheduler: object, what: str) -> MultiTurnScheduler:
    """`scheduler` as a `compat.swift.MultiTurnScheduler`: ours as it is, one built on ms-swift's
    own base classes (its release `multi_turn.py`) wrapped by its hooks; a ValueError naming
    `what` for anything else."""
    if isinstance(scheduler, MultiTurnScheduler):
        return scheduler
    if is_swift_style(type(scheduler)):
        return wrap(scheduler)
    raise ValueError(
        f"{what} needs a compat.swift.MultiTurnScheduler or a scheduler with ms-swift's hooks "
        f"({', '.join(HOOKS)}), got {type(scheduler).__name__}"
    )
