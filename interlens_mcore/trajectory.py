"""Token-space data model: messages, turn spans and trajectories.

A trajectory is one participant's view of one conversation, exactly as the engine saw it:
sampled ids are kept verbatim, every other message was rendered once when it was appended.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    """Why a conversation (and so its trajectories) ended."""

    RUNNING = "running"
    STOPPED = "stopped"  # a stop condition fired
    MAX_TURNS = "max_turns"  # the caller's turn count ran out
    FAILED = "failed"
    TIMEOUT = "timeout"  # an environment, tool or scheduler step ran past its time limit


@dataclass(kw_only=True)
class Message:
    """One committed message of a conversation, as text plus who said it."""

    speaker: str  # participant name
    content: str
    role: str = "user"  # role others see it under: "user", "tool", ...
    token_ids: list[int] | None = None  # sampled ids, for a policy message kept verbatim
    logprobs: list[float] | None = None  # one per sampled id
    finish_reason: str | None = None  # "stop" | "length" for generated messages
    edited: bool = False  # a hook changed the text: the sampled ids no longer describe it

    def __post_init__(self) -> None:
        if not isinstance(self.content, str):
            raise ValueError(f"Message.content must be str, got {type(self.content).__name__}")
        if self.logprobs is not None and (
            self.token_ids is None or len(self.logprobs) != len(self.token_ids)
        ):
            raise ValueError("Message.logprobs needs token_ids of the same length")


@dataclass(frozen=True, kw_only=True)
class TurnSpan:
    """Tokens [start, end) of a trajectory that one message occupies."""

    start: int
    end: int
    speaker: str
    trained: bool  # tokens in this span carry loss-mask 1 where the participant sampled them
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"TurnSpan needs 0 <= start <= end, got [{self.start}, {self.end})")


@dataclass(kw_only=True)
class Trajectory:
    """One (conversation, trainable participant) in token space, ready for `build_batch`."""

    token_ids: list[int]  # [T] the participant's whole view
    loss_mask: list[int]  # [T] 1 only on tokens this participant sampled and trains on
    rollout_logprobs: list[float] | None  # one per loss-mask-1 token, or None (IS off)
    turns: list[TurnSpan] = field(default_factory=list)  # spans of the trained turns
    participant: str = "policy"
    group: int = 0  # prompt index: samples of one group share their advantage baseline
    status: Status = Status.STOPPED
    reward: float | None = None
    infos: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_tokens(self.token_ids, self.loss_mask, self.rollout_logprobs, where="Trajectory")
        for span in self.turns:
            if span.end > len(self.token_ids):
                raise ValueError(
                    f"Trajectory turn span [{span.start}, {span.end}) exceeds {len(self.token_ids)} tokens"
                )

    @property
    def num_trained_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def logprobs_complete(self) -> bool:
        """True when IS correction can use this sample: one finite logprob per trained token."""
        return self.rollout_logprobs is not None and len(self.rollout_logprobs) == sum(self.loss_mask)


def validate_tokens(
    token_ids: list[int],
    loss_mask: list[int],
    logprobs: list[float] | None,
    *,
    where: str,
) -> None:
    """Raise ValueError naming `where` unless ids, mask and logprobs describe one sequence."""
    if len(loss_mask) != len(token_ids):
        raise ValueError(
            f"{where}: loss_mask has {len(loss_mask)} entries but token_ids has {len(token_ids)}"
        )
    bad = [m for m in loss_mask if m not in (0, 1)]
    if bad:
        raise ValueError(f"{where}: loss_mask values must be 0 or 1, got {bad[0]!r}")
    if logprobs is not None:
        nonfinite = [x for x in logprobs if not math.isfinite(x)]
        if nonfinite:
            raise ValueError(f"{where}: rollout_logprobs must be finite, got {nonfinite[0]!r}")


def complete_or_none(logprobs: list[float] | None, loss_mask: list[int]) -> tuple[list[float] | None, bool]:
    """The completeness rule: keep logprobs only if there is one per loss-mask-1 token."""
    if logprobs is not None and len(logprobs) == sum(loss_mask):
        return logprobs, True
    return None, False
