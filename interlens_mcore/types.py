"""Token-space data model: messages, turn spans and trajectories.

A trajectory is one participant's view of one conversation, exactly as the engine saw it:
sampled ids are kept verbatim, every other message was rendered once when it was appended, and
nothing the engine could not condition on (a message or closing tokens past its context) is in it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal


class Status(str, enum.Enum):
    """Why a conversation (and so its trajectories) ended."""

    RUNNING = "running"
    STOPPED = "stopped"  # a stop condition fired
    MAX_TURNS = "max_turns"  # the caller's turn count ran out
    FAILED = "failed"
    TIMEOUT = "timeout"  # an environment, tool or scheduler step ran past its time limit
    TRUNCATED = "truncated"  # the conversation outgrew its engine's context


# a transcript message as reward functions read it: {"role", "content", "name"?, ...} (JSON)
ChatMessage = dict[str, object]

# which turns of a trajectory are trained: all of them, the last one, or one bool per turn
TrainTurns = Literal["all", "last"] | Sequence[bool]


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
class TrajectoryInfo:
    """What this package records about a trajectory, typed; anything else lives in `extra`.

    Every rollout path fills the same fields: lineups (`co_step`), native schedulers and
    ms-swift schedulers. `extra` holds what environments wrote to `conv.infos` and what
    schedulers returned as `rollout_infos` (a gym's `return`, a tool's `tool_calls`, the
    scheduler's `reward`), under their own keys.

    Read fields as attributes (`t.infos.completion`). Item access (`t.infos["completion"]`,
    `t.infos.get("attempts")`) reads a field by its name and any other key from `extra`, so
    reward functions written against the earlier plain dict keep working.
    """

    conversation: str | None = None  # the sample's id: conversation id, or the request's uuid
    seat: str = "policy"  # the participant whose view this is
    index: int | None = None  # the sample's place in the step, unique across ranks
    seed: int | None = None  # the sample's random stream
    completion: str = ""  # the text of the seat's last message
    messages: list[ChatMessage] = field(default_factory=list)  # the transcript as the seat saw it
    # how many of `messages` open the conversation (the row's prompt); None: those before the
    # seat's first message (what a scheduler's or an agent's request opened with)
    opening: int | None = None
    env_reward: float | None = None  # the environments' (or the scheduler's) reward for the seat
    success: float | None = None  # in [0, 1], where the task reports one
    outcome: dict[str, float] | None = None  # seat -> 1 win, 1/2 tie, 0 loss (multi-seat games)
    turns: int = 0  # turns the conversation took (engine calls, for schedulers)
    finish_reasons: list[str | None] = field(default_factory=list)  # one per turn of the seat
    stop_reason: str | None = None  # why the conversation ended (a stop, a timeout, a failure)
    logprobs_complete: bool = True  # False: rollout logprobs dropped, IS correction off here
    # every reward function returned None (TRL's "unscorable"): out of the baseline and the loss
    unscored: bool = False
    extra: dict[str, object] = field(default_factory=dict)

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls)) - {"extra"}

    @classmethod
    def split(cls, values: Mapping[str, object]) -> dict[str, object]:
        """`values` without the keys that name a field: what goes to `extra`."""
        names = cls.names()
        return {k: v for k, v in values.items() if k not in names}

    @classmethod
    def of(cls, values: Mapping[str, object]) -> TrajectoryInfo:
        """The record of a plain dict: keys that name a field set it, the others go to `extra`."""
        info = cls()
        for key, value in values.items():
            info[key] = value
        return info

    def __getitem__(self, key: str) -> object:
        if key in self.names():
            return getattr(self, key)
        return self.extra[key]

    def __setitem__(self, key: str, value: object) -> None:
        if key in self.names():
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self.names() or key in self.extra

    def get(self, key: str, default: object = None) -> object:
        return self[key] if key in self else default


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
    # a plain dict given here becomes a TrajectoryInfo (`TrajectoryInfo.of`)
    infos: TrajectoryInfo = field(default_factory=TrajectoryInfo)

    def __post_init__(self) -> None:
        if not isinstance(self.infos, TrajectoryInfo):  # a plain dict, as trajectories had before
            self.infos = TrajectoryInfo.of(self.infos)
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
        return logprobs_fit(self.rollout_logprobs, self.loss_mask)


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


def logprobs_fit(logprobs: Sequence[float] | None, loss_mask: Sequence[int]) -> bool:
    """The completeness rule, its only copy: one rollout logprob per loss-mask-1 token.

    Tokens without a loss contribute no logprob, so a piece with nothing trained (an empty
    reply) fits with no logprobs at all and cannot turn IS correction off for its sample.
    """
    if logprobs is None:
        return not any(loss_mask)
    return len(logprobs) == sum(loss_mask)


@dataclass(kw_only=True)
class TurnTokens:
    """Where one response sits in a token sequence, and which of its tokens are trained."""

    start: int  # first token of the response in the sequence
    mask: list[int]  # [end - start] 1 where trained
    logprobs: list[float] | None  # one per mask-1 token, or None
    finish_reason: str | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.mask)


def check_train_turns(train: TrainTurns, where: str) -> None:
    ok = train in ("all", "last") if isinstance(train, str) else isinstance(train, (list, tuple))
    if not ok or (not isinstance(train, str) and not all(isinstance(b, bool) for b in train)):
        raise ValueError(f"{where}: train_turns must be 'all', 'last' or a list of bools, got {train!r}")


def select_turns(turns: Sequence[TurnTokens], train: TrainTurns, where: str) -> list[TurnTokens]:
    """The trained turns: all, the last, or those whose entry of a per-turn bool mask is true."""
    if train == "all":
        return list(turns)
    if train == "last":
        return list(turns[-1:])
    check_train_turns(train, where)
    if len(train) != len(turns):
        raise ValueError(f"{where}: train_turns has {len(train)} entries for {len(turns)} turns")
    return [t for t, keep in zip(turns, train, strict=True) if keep]


def assemble(
    token_ids: list[int],
    turns: Sequence[TurnTokens],
    *,
    train: TrainTurns = "all",
    participant: str,
    group: int,
    status: Status,
    infos: TrajectoryInfo,
) -> Trajectory:
    """A trajectory over `token_ids`: the chosen turns' masks and, if every chosen turn's
    logprobs fit it (`logprobs_fit`, turn by turn, so a turn short of a logprob cannot borrow a
    neighbour's surplus), their logprobs; else none, and `infos.logprobs_complete` says so.
    `infos` is completed with the seat and every turn's finish reason."""
    chosen = select_turns(turns, train, f"trajectory of {participant!r}")
    mask = [0] * len(token_ids)
    for t in chosen:
        mask[t.start : t.end] = t.mask
    complete = all(logprobs_fit(t.logprobs, t.mask) for t in chosen)
    logprobs = [x for t in chosen for x in t.logprobs or []] if complete else None
    spans = [
        TurnSpan(
            start=t.start, end=t.end, speaker=participant, trained=1 in t.mask, finish_reason=t.finish_reason
        )
        for t in chosen
    ]
    return Trajectory(
        token_ids=list(token_ids),
        loss_mask=mask,
        rollout_logprobs=logprobs,
        turns=spans,
        participant=participant,
        group=group,
        status=status,
        infos=dataclasses.replace(
            infos,
            seat=participant,
            finish_reasons=[t.finish_reason for t in turns],
            logprobs_complete=complete,
        ),
    )
