"""`outcome`: the one rule for how both drivers end a conversation or request early."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from interlens_mcore.rollout.outcome import (
    Room,
    SampleErrors,
    check_on_sample_error,
    fail,
    labelled,
    time_out,
    truncate,
)
from interlens_mcore.types import Status


@dataclass
class Ended:
    calls: list[tuple[Status, str]] = field(default_factory=list)

    def end(self, status: Status, reason: str) -> None:
        self.calls.append((status, reason))


def test_room_budgets_and_decides_truncation():
    room = Room.after(prompt_tokens=90, max_context=100)
    assert room.fits and room.left == 10
    assert room.budget(4) == 4 and room.budget(32) == 10
    assert not room.filled(4, cap=4)  # the turn's own cap ended it
    assert room.filled(10, cap=32)  # the context ended it: no next turn
    assert not room.filled(10, cap=10)  # both at once: the cap; the next prompt finds no room
    full = Room.after(prompt_tokens=100, max_context=100)
    assert not full.fits and full.filled(0, cap=4)  # a prompt that fills the context gets no turn


def test_endings_name_the_call_and_the_failure():
    target = Ended()
    time_out(target, "env", 0.5, 3)
    truncate(target, "prompt of 9 tokens fills 'e''s context of 8")
    exc = ValueError("bad reply")
    fail(target, exc, what="environment", note="conversation c1", known="c1")
    assert target.calls == [
        (Status.TIMEOUT, "env exceeded 0.5 s at turn 3"),
        (Status.TRUNCATED, "prompt of 9 tokens fills 'e''s context of 8"),
        (Status.FAILED, "environment: ValueError: bad reply"),  # what failed, first: the counted cause
    ]
    assert exc.__notes__ == ["conversation c1"]
    fail(Ended(), exc, what="environment", note="conversation c1", known="c1")  # noted once
    assert exc.__notes__ == ["conversation c1"]
    assert labelled(Status.TIMEOUT, "env exceeded 1 s at turn 2") == "timeout: env exceeded 1 s at turn 2"
    assert labelled(Status.TRUNCATED, "x") == "context: x" and labelled(Status.FAILED, "E: y") == "E: y"


def test_a_time_out_needs_a_limit():
    with pytest.raises(AssertionError, match="only a call run under a limit times out"):
        time_out(Ended(), "step", None, 1)


def test_sample_errors_raise_the_first_or_keep_them():
    first, second = ValueError("one"), KeyError("two")
    with pytest.raises(ValueError, match="one"):
        SampleErrors("raise").settle([first, second])
    SampleErrors("skip").settle([first, second])  # kept on their samples: nothing raised
    SampleErrors("raise").settle([])
    with pytest.raises(
        ValueError, match=r"co_step: on_sample_error must be one of \('skip', 'raise'\), got 'later'"
    ):
        check_on_sample_error("later", "co_step: on_sample_error")
