"""Where tools run: worker processes that are killed at a call's limit, CPU and memory limits,
every BaseException a tool raises read by the policy, and the tools refused there.

Limits are generous against a loaded machine: a healthy call takes milliseconds against a
LIMIT of seconds, and the bad ones would run SPIN seconds. The one bound on wall time says a
round did not wait for a bad call.
"""

from __future__ import annotations

import json
import time

import pytest
import tools_for_workers as tw

from interlens_mcore.rollout.conversation import Conversation, Scripted
from interlens_mcore.rollout.costep import co_step
from interlens_mcore.rollout.stop import MaxTurns
from interlens_mcore.tasks import dataset as ds_tasks
from interlens_mcore.tools import ToolEnvironment, WorkerLimits, with_tools
from interlens_mcore.types import Status

LIMIT = 5.0  # seconds a call may take; a healthy one takes milliseconds
SPIN = 30.0  # what a bad call would take if nobody stopped it


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def play_round(env: ToolEnvironment, replies: list[list[str]]) -> list[Conversation]:
    """One conversation per script, all played at once: a tool turn of each is one round."""
    convs = [
        Conversation([Scripted("policy", script, role="assistant"), env], run_until=MaxTurns(2 * len(script)))
        for script in replies
    ]
    co_step(convs, step_timeout_s=120.0)  # against a hang only
    return convs


def results(convs: list[Conversation]) -> list[str]:
    return [c.messages[1].content for c in convs]


def test_a_tool_spinning_in_c_is_killed_at_its_limit_while_its_neighbours_finish():
    env = ToolEnvironment(
        [tw.add, tw.spin_in_c, tw.block], tool_timeout_s=LIMIT, worker_limits=WorkerLimits(workers=4)
    )
    healthy = [[call("add", a=i, b=1), "done"] for i in range(4)]
    assert results(play_round(env, healthy)) == ["1", "2", "3", "4"]  # four workers up and warm
    start = time.monotonic()
    convs = play_round(
        env,
        [
            [call("spin_in_c", seconds=SPIN), "done"],
            [call("block", seconds=SPIN), "done"],  # an async tool that blocks its loop
            *healthy[:3],
        ],
    )
    assert time.monotonic() - start < SPIN - 5  # the round did not wait for either
    spun, blocked, *rest = results(convs)
    # killed at the wall-clock limit, or by the kernel at the same number of CPU seconds
    assert f"ran past {LIMIT:g} s" in spun or f"used more than {LIMIT:g} s of CPU time" in spun, spun
    assert spun.startswith("error: tool 'spin_in_c'") and "worker process" in spun
    assert blocked.startswith("error: tool 'block' ran past") and "killed" in blocked
    assert rest == ["1", "2", "3"]  # the neighbours finished, with their results
    assert all(c.status is Status.STOPPED for c in convs)
    assert [c.infos["tool_errors"] for c in convs] == [1, 1, 0, 0, 0]
    # the killed workers were replaced: the pool serves the next round in full
    assert results(play_round(env, healthy)) == ["1", "2", "3", "4"]


BASE_EXCEPTIONS = [
    (call("exits", code=3), "error: tool 'exits' raised SystemExit: 3"),
    (call("interrupts", x=1), "error: tool 'interrupts' raised KeyboardInterrupt"),
    (call("interrupts_async", x=1), "error: tool 'interrupts_async' raised KeyboardInterrupt"),
    (call("cancels_itself", x=1), "error: tool 'cancels_itself' raised CancelledError"),
    (
        call("unshowable", x=1),
        "error: tool 'unshowable' returned a _Unshowable whose text could not be made: "
        "ValueError: no repr for you",
    ),
    (
        call("unspeakable", x=1),
        "error: tool 'unspeakable' raised _Unspeakable: <its message could not be read: RuntimeError>",
    ),
]


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_every_base_exception_is_the_tools_error_message(isolation):
    tools = [tw.add, tw.exits, tw.interrupts, tw.interrupts_async, tw.cancels_itself, tw.unshowable]
    env = ToolEnvironment([*tools, tw.unspeakable], tool_timeout_s=LIMIT, isolation=isolation, max_calls=8)
    # all six in one reply, then a healthy call: the conversation goes on after each
    script = ["".join(c for c, _ in BASE_EXCEPTIONS), call("add", a=2, b=3), "done"]
    (conv,) = play_round(env, [script])
    assert conv.messages[1].content.split("\n") == [line for _, line in BASE_EXCEPTIONS]
    assert conv.messages[3].content == "5"
    assert conv.status is Status.STOPPED and conv.infos["tool_calls"] == 7
    assert conv.infos["tool_errors"] == 6 and conv.infos["tool_valid_calls"] == 7


def test_cpu_time_and_memory_limits_hold_inside_the_worker():
    # no wall-clock limit: the kernel's CPU limit alone ends the spin
    limits = WorkerLimits(workers=2, cpu_s=1, memory_mb=256)
    env = ToolEnvironment([tw.spin, tw.allocate], tool_timeout_s=None, worker_limits=limits, max_calls=3)
    script = [call("spin", seconds=SPIN) + call("allocate", megabytes=4096) + call("allocate", megabytes=16)]
    (conv,) = play_round(env, [script + ["done"]])
    spun, big, small = conv.messages[1].content.split("\n")[:3]
    assert spun == "error: tool 'spin' used more than 1 s of CPU time (the kernel stopped its worker process)"
    assert big == "error: tool 'allocate' raised MemoryError"  # past 256 MB: the tool's own error
    assert small == str(16 * 2**20)  # the same worker goes on: the limit held only for that call


def test_the_worker_protocol_cannot_be_broken_by_a_tool():
    env = ToolEnvironment([tw.add, tw.chatty, tw.forges, tw.exits_hard], tool_timeout_s=LIMIT, max_calls=5)
    script = [
        call("chatty", x=1) + call("forges", x=1) + call("add", a=1, b=1) + call("exits_hard", code=4)
        + call("add", a=2, b=2),
        "done",
    ]  # fmt: skip
    (conv,) = play_round(env, [script])
    chatty, forged, two, hard, four = conv.messages[1].content.split("\n")[:5]
    assert chatty == "read ''"  # its stdin is empty, its print went to stderr
    # bytes that are not an answer are refused as such (never unpickled), the worker killed
    assert forged.startswith("error: tool 'forges' got a malformed answer from its worker process (")
    assert hard == "error: tool 'exits_hard' ended its worker process (exit status 4)"
    assert (two, four) == ("2", "4")  # each after a fresh worker


def closure_tool():
    def inner(x: int) -> int:
        """A closure.

        Args:
            x: anything
        """
        return x

    return inner


def test_tools_a_worker_cannot_import_are_refused_unless_run_in_process(tmp_path):
    inner = closure_tool()
    with pytest.raises(ValueError, match=r"ToolEnvironment: tool 'inner' cannot run in a worker process.*"
                       r"defined inside a function.*isolation='thread'"):  # fmt: skip
        ToolEnvironment([inner])
    with pytest.raises(ValueError, match="isolation must be one of"):
        ToolEnvironment([tw.add], isolation="fork")
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"prompt": "1 + 1", "answer": 2}))
    with pytest.raises(ValueError, match="with_tools: tool 'inner' cannot run in a worker process"):
        with_tools(ds_tasks.source(str(path), eval_fraction=0.0), [inner])
    # in this process it runs
    env = ToolEnvironment([inner], isolation="thread", tool_timeout_s=LIMIT)
    (conv,) = play_round(env, [[call("inner", x=7), "done"]])
    assert conv.messages[1].content == "7"


@pytest.mark.parametrize(
    "bad", [{"workers": 0}, {"cpu_s": 0}, {"memory_mb": float("inf")}, {"workers": True}]
)
def test_bad_worker_limits_are_rejected(bad):
    with pytest.raises(ValueError, match=f"WorkerLimits.{next(iter(bad))} must be"):
        WorkerLimits(**bad)
