"""`MultiTurnScheduler` with ms-swift's constructor, attributes, hooks and helpers.

A scheduler file written for ms-swift runs here after changing only its import::

    from interlens_mcore.compat.swift import MultiTurnScheduler

    class ToolScheduler(MultiTurnScheduler):
        def check_finished(self, infer_request, response_choice, current_turn):
            if "<tool_call>" not in response_choice.message.content:
                return True
            return super().check_finished(infer_request, response_choice, current_turn)

        def step(self, infer_request, response_choice, current_turn):
            result = run_tool(response_choice.message.content)
            infer_request.messages.append({"role": "tool", "content": result})
            return {"infer_request": infer_request}

The hooks mean what they mean in ms-swift's colocate driver (`compat.swift.run` drives them):
`on_trajectory_start` (sync or async) runs once before the first turn and may rewrite the
requests' messages; after each turn every request's `on_turn_end` runs concurrently, then
`check_finished` for every request in order (also when the hook returned `done`, which then
decides, `None` meaning "not done"); unfinished requests go through `step`.
`max_turns` of 0 or None means no cap. `on_trajectory_end` runs once at the end, also after a
failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...chat import Tokenizer
from ...engines.base import Engine
from .types import ChatCompletionResponseChoice, RolloutInferRequest, choice_logprobs


@dataclass
class InferEngine:
    """What a scheduler reaches as `self.infer_engine`: the rollout's engine and its tokenizer."""

    engine: Engine
    tokenizer: Tokenizer | None


class MultiTurnScheduler:
    """Base class of ms-swift-style schedulers (see the module docstring)."""

    def __init__(
        self, infer_engine: InferEngine | None = None, max_turns: int | None = None, *args, **kwargs
    ):
        self.infer_engine = infer_engine
        self._tokenizer = kwargs.get("tokenizer")
        self.max_turns = max_turns

    @property
    def engine(self) -> InferEngine | None:
        return self.infer_engine

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer passed as `tokenizer=`, else the engine's."""
        if self._tokenizer is not None:
            return self._tokenizer
        return self.infer_engine.tokenizer if self.infer_engine is not None else None

    def bind(self, engine: Engine, tokenizer: Tokenizer) -> None:
        """Give a scheduler built without an engine (by a task source) the rollout's engine."""
        if self.infer_engine is None:
            self.infer_engine = InferEngine(engine=engine, tokenizer=tokenizer)
        if self._tokenizer is None:
            self._tokenizer = tokenizer

    async def on_trajectory_start(self, requests: list[RolloutInferRequest]) -> None:
        """Before the first turn, once for this rank's requests; may rewrite their messages."""

    async def on_turn_end(
        self,
        infer_request: RolloutInferRequest,
        response_choice: ChatCompletionResponseChoice,
        current_turn: int,
    ) -> dict[str, Any]:
        """After the reply is appended; may return `done` (decides over check_finished) and `rollout_infos`.

        On the turn a request finishes, `response_token_ids` / `response_loss_mask` /
        `rollout_logprobs` returned here shape the final turn (no `step` runs for it).
        """
        return {}

    async def on_trajectory_end(
        self, requests: list[RolloutInferRequest], error: BaseException | None = None
    ) -> None:
        """Once after the rollout, also after a failure (`error`); release environments here."""

    def check_finished(
        self,
        infer_request: RolloutInferRequest,
        response_choice: ChatCompletionResponseChoice,
        current_turn: int,
    ) -> bool:
        """Default: a reply cut at the token cap, or `max_turns` reached (0 / None: no cap)."""
        if response_choice.finish_reason == "length":
            return True
        cap = self.max_turns
        return cap is not None and cap != 0 and current_turn >= cap

    def step(
        self,
        infer_request: RolloutInferRequest,
        response_choice: ChatCompletionResponseChoice,
        current_turn: int,
    ) -> dict[str, Any]:
        """Return {"infer_request": the (mutated) request, ...optional overrides and rollout_infos}."""
        raise NotImplementedError(f"{type(self).__name__}: implement step() (a MultiTurnScheduler needs one)")

    @staticmethod
    def _extract_logprobs_from_choice(response_choice: ChatCompletionResponseChoice) -> list[float]:
        return choice_logprobs(response_choice)


multi_turns: dict[str, type[MultiTurnScheduler]] = {}
"""Schedulers by name, as ms-swift plugin files register them (`multi_turns["name"] = Cls`)."""
