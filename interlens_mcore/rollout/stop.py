"""Stop conditions. Every conversation owns its own instances: the runner clones what it is
given, so no counter is ever shared between conversations.

Example::

    conv = Conversation(lineup, prompt, run_until=AnyOf(MaxTurns(6), TokenBudget(256, 64)))
    with stop_when(Predicate(lambda c: "correct" in c.messages[-1].content)):
        co_step(convs, turns=None)   # each conversation gets its own copy of the ambient one
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..types import Message


class Conversation(Protocol):
    """What a stop condition reads of a conversation (`interlens_mcore.Conversation` has it): a
    protocol, so that this module, which `conversation` imports, imports nothing of it."""

    messages: list[Message]
    turns_taken: int


_AMBIENT: contextvars.ContextVar[tuple[StopCondition, ...]] = contextvars.ContextVar(
    "interlens_ambient_stops", default=()
)


class StopCondition(ABC):
    """Decides when one conversation ends; may cap the tokens of its next policy turn."""

    def token_cap(self, conv: Conversation) -> int | None:
        """Most new tokens the next policy turn may sample (None: no cap)."""
        return None

    def observe(self, conv: Conversation, message: Message | None, generated: int) -> None:
        """Called after every turn with the committed message (None if dropped or silent) and
        the number of tokens the engine generated for it."""

    @abstractmethod
    def should_stop(self, conv: Conversation) -> bool: ...

    def clone(self) -> StopCondition:
        """This condition's copy for one conversation (fresh counters); override for state
        that `copy.deepcopy` cannot copy (a lock, a client)."""
        return copy.deepcopy(self)


class MaxTurns(StopCondition):
    """Stop after `n` turns of the conversation (every speaker's turn counts)."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"MaxTurns(n) needs n >= 1, got {n}")
        self.n = n

    def should_stop(self, conv: Conversation) -> bool:
        return conv.turns_taken >= self.n


class TokenBudget(StopCondition):
    """Cap the policy tokens of a conversation and of each turn; lands exactly on the budget.

    The last turn is capped at what remains, so a conversation spends `per_conversation` tokens
    exactly unless the model stops on its own (matched-compute comparisons rely on this).
    """

    def __init__(self, per_conversation: int, per_turn: int | None = None):
        if per_conversation < 1:
            raise ValueError(f"TokenBudget.per_conversation must be >= 1, got {per_conversation}")
        if per_turn is not None and per_turn < 1:
            raise ValueError(f"TokenBudget.per_turn must be >= 1 or None, got {per_turn}")
        self.per_conversation = per_conversation
        self.per_turn = per_turn
        self.used = 0

    def token_cap(self, conv: Conversation) -> int | None:
        left = self.per_conversation - self.used
        return left if self.per_turn is None else min(left, self.per_turn)

    def observe(self, conv: Conversation, message: Message | None, generated: int) -> None:
        self.used += generated

    def should_stop(self, conv: Conversation) -> bool:
        return self.used >= self.per_conversation


class Predicate(StopCondition):
    """Stop when `fn(conv)` is true (e.g. a tool said the task is solved).

    Each conversation gets a deep copy of `fn`: a callable object keeps its state per
    conversation (a plain function is copied as itself).
    """

    def __init__(self, fn: Callable[[Conversation], bool], name: str = ""):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "predicate")

    def should_stop(self, conv: Conversation) -> bool:
        return bool(conv.messages) and bool(self.fn(conv))

    def clone(self) -> StopCondition:
        return Predicate(copy.deepcopy(self.fn), self.name)


class AnyOf(StopCondition):
    """Stop when any part stops; the token cap is the smallest of the parts' caps."""

    def __init__(self, *parts: StopCondition):
        if not parts:
            raise ValueError("AnyOf needs at least one stop condition")
        for p in parts:
            if not isinstance(p, StopCondition):
                raise ValueError(f"AnyOf parts must be StopCondition, got {type(p).__name__}")
        self.parts = list(parts)

    def token_cap(self, conv: Conversation) -> int | None:
        caps = [c for c in (p.token_cap(conv) for p in self.parts) if c is not None]
        return min(caps) if caps else None

    def observe(self, conv: Conversation, message: Message | None, generated: int) -> None:
        for p in self.parts:
            p.observe(conv, message, generated)

    def should_stop(self, conv: Conversation) -> bool:
        return any(p.should_stop(conv) for p in self.parts)

    def clone(self) -> StopCondition:
        return AnyOf(*(p.clone() for p in self.parts))


@contextlib.contextmanager
def stop_when(*conditions: StopCondition) -> Iterator[None]:
    """Install ambient stop conditions for the conversations `co_step` steps inside the block.

    Each conversation receives its own clone of each; a condition that is also in a
    conversation's own `run_until` (the same object) is counted once. A conversation continued
    by a later chunk (`co_step(convs, turns=2)` again) gets the conditions it has not had yet,
    from then on: a `TokenBudget` counts the tokens after it, `MaxTurns` every turn, and one
    that already holds ends the conversation before its next turn. A condition stays with a
    conversation once it has it.
    """
    for c in conditions:
        if not isinstance(c, StopCondition):
            raise ValueError(f"stop_when takes StopCondition objects, got {type(c).__name__}")
    token = _AMBIENT.set(_AMBIENT.get() + tuple(conditions))
    try:
        yield
    finally:
        _AMBIENT.reset(token)


def ambient_conditions() -> tuple[StopCondition, ...]:
    return _AMBIENT.get()
