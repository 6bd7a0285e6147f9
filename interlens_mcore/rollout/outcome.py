"""How a conversation or a request ends early: the context fills, a step times out, a call fails.

Both drivers, `co_step` (lineups) and `run_multi_turn` (schedulers), decide these endings
here, so a lineup's conversation and a scheduler's request end alike:

- the context: a prompt the engine's context cannot hold gets no turn, and a turn that fills
  the context (not its own token cap) is the last one; both end with status TRUNCATED, the
  earlier turns kept (`Room`);
- a time limit: an environment, hook or step past its limit ends that conversation or
  request with status TIMEOUT, not as a failure (`time_out`);
- a failure: a raising hook, environment or bad output ends its own conversation or request
  FAILED, the reason naming what failed, then the exception's type and text
  (`"environment: ValueError: bad reply"`; `fail`). Whether the driver then raises for the
  whole rollout (`on_sample_error="raise"`) or lets the others carry on ("skip") is the
  driver's `SampleErrors`.

A driver's record of one conversation or request is an `Ending`: it is told the status and
the reason, and keeps them where its users read them (`Conversation.stop_reason`, a
scheduler output's `error` or `rollout_infos["timeout"]`).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Literal, Protocol

from ..types import Status


class Ending(Protocol):
    """What a driver ends: a lineup's `Conversation`, a scheduler request's slot."""

    def end(self, status: Status, reason: str) -> None: ...


@dataclass(frozen=True)
class Room:
    """New tokens an engine's context leaves after a prompt (<= 0: the prompt fills it)."""

    left: int

    @classmethod
    def after(cls, prompt_tokens: int, max_context: int) -> Room:
        return cls(max_context - prompt_tokens)

    @property
    def fits(self) -> bool:
        """The engine can sample at least one token after the prompt."""
        return self.left > 0

    def budget(self, cap: int) -> int:
        """The token cap of the turn: its own cap, or less where the context ends first."""
        return min(cap, self.left)

    def filled(self, generated: int, cap: int) -> bool:
        """The context, not the turn's own cap, ended a turn of `generated` tokens: no next turn.

        Where the context leaves exactly the cap, the cap ended the turn; the next prompt then
        finds no room (`fits`) and that turn is the one that ends TRUNCATED.
        """
        return self.left < cap and generated >= self.left


def prompt_fills(prompt_tokens: int, engine: str, max_context: int) -> str:
    return f"prompt of {prompt_tokens} tokens fills {engine!r}'s context of {max_context}"


def turn_fills(turn: int, engine: str, max_context: int) -> str:
    return f"turn {turn} reached {engine!r}'s context of {max_context} tokens"


def exceeded(call: str, limit: float | None, turn: int) -> str:
    """The reason of a timeout: which call ran past which limit, at which turn."""
    assert limit is not None, "only a call run under a limit times out"
    return f"{call} exceeded {limit:g} s at turn {turn}"


def time_out(target: Ending, call: str, limit: float | None, turn: int) -> None:
    target.end(Status.TIMEOUT, exceeded(call, limit, turn))


def truncate(target: Ending, reason: str) -> None:
    target.end(Status.TRUNCATED, reason)


def fail(
    target: Ending, exc: Exception, *, what: str, note: str | None = None, known: str | None = None
) -> None:
    """End `target` FAILED with the reason `"<what>: <ExcType>: <text>"`: `what` (scheduler,
    environment, tool, hook) is the cause's category the step's metrics count. `note` (which
    conversation or request) joins the exception's notes unless a note already says it or its
    text mentions `known`, so the error raised later names the conversation or request."""
    notes = getattr(exc, "__notes__", ())
    if note is not None and not any(note in n for n in notes) and (known is None or known not in str(exc)):
        exc.add_note(note)
    target.end(Status.FAILED, failure_reason(what, exc))


def failure_reason(what: str, exc: BaseException) -> str:
    """How a failed sample's stop reason names its cause: `"scheduler: KeyError: 'x'"`; where
    the exception was raised is kept beside it (`failure_site`)."""
    reason = f"{what}: {type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        _SITES.pop(reason, None)  # the newest at the end: the oldest leave first
        _SITES[reason] = f"{frames[-1].filename}:{frames[-1].lineno}"
        while len(_SITES) > _MAX_SITES:
            del _SITES[next(iter(_SITES))]
    return reason


# a failure's reason -> the file:line its exception was raised at, on this process; the reason
# stays the stop reason's text (records and figures read it), the site only names the line
_SITES: dict[str, str] = {}
_MAX_SITES = 4096  # distinct reasons kept (a text that names each sample makes every one new)


def failure_site(reason: str | None) -> str | None:
    """The file:line where the exception behind `reason` was raised on this process (None: not
    known here, or not a failure)."""
    return None if reason is None else _SITES.get(reason)


OnSampleError = Literal["skip", "raise"]
ON_SAMPLE_ERROR: tuple[OnSampleError, ...] = ("skip", "raise")


def check_on_sample_error(value: object, where: str) -> None:
    if value not in ON_SAMPLE_ERROR:
        raise ValueError(f"{where} must be one of {ON_SAMPLE_ERROR}, got {value!r}")


@dataclass(frozen=True)
class SampleErrors:
    """What a driver does with the failures of single samples once each is marked FAILED:
    "raise" sends the first to the vote (every rank then raises), "skip" keeps them on their
    samples and the rollout carries on. Failures that are not one sample's (an engine call,
    the vote, bad arguments) never come here: they always fail the rollout."""

    on_sample_error: OnSampleError = "raise"

    def settle(self, errors: list[Exception]) -> None:
        if errors and self.on_sample_error == "raise":
            raise errors[0]


# how a lineup's stop reason names an early end: "timeout: env exceeded 2 s at turn 3"
_LABELS = {Status.TIMEOUT: "timeout", Status.TRUNCATED: "context"}


def labelled(status: Status, reason: str) -> str:
    """`reason` as a conversation's stop reason: prefixed by what ended it (a failure is not)."""
    label = _LABELS.get(status)
    return reason if label is None else f"{label}: {reason}"
