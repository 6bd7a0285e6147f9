"""A lineup participant that runs the tools a policy calls, in front of the task's environment.

After each policy turn, `ToolEnvironment` parses the reply. A reply that calls tools gets
their results as one `tool` message (rendered once, loss mask 0) and the policy speaks
again; any other reply goes to the wrapped environment (the task's judge, game master, ...),
which answers as it would without tools. So the wrapped environment only ever sees replies
that are not tool calls, and its reward is the task's reward.

A malformed call, an unknown tool, wrong arguments, a tool that raises (any `BaseException`:
`SystemExit`, `KeyboardInterrupt`, an exception whose message raises), returns a value whose
text cannot be made, or runs past `tool_timeout_s` becomes an `error: ...` line in the result
the policy reads, and is counted; the rollout goes on. After `max_calls` calls in one
conversation, replies go to the wrapped environment whatever they hold, which bounds the
conversation's turns.

Where tools run (`isolation`):
- `"process"` (the default): in worker processes (`pool`), sync and async tools alike, under
  `worker_limits` (CPU time, memory), each call killed at `tool_timeout_s`; calls of one round
  run at once, up to `worker_limits.workers`. No tool can hold the rank: one that spins in C
  code is killed at its limit while the others finish. Building the environment waits for the
  workers to start, so their start-up never counts against a step's time limit. Each tool must
  be importable by name (`Tool.reference`); one that is not is refused here, with the reason.
- `"thread"`: in this process, one call at a time, each in a daemon thread (an async tool in
  its own event loop there) awaited up to `tool_timeout_s`. For tools that cannot be imported
  (closures); a thread cannot be killed, so a tool that holds the GIL stalls the rank, and one
  that never returns keeps its thread.

Counts kept in `conv.infos` (summed over the conversation, for the trainer's metrics):
`tool_calls` (calls attempted, well-formed or not), `tool_valid_calls` (well-formed calls of
a known tool with acceptable arguments), `tool_errors` (calls that produced an error line),
`tool_turns` (replies that called tools). At the reply that is not a tool call (the answer),
two rates that evaluation reports with their intervals (`eval/rate/...`): `rate/valid_call`
(the conversation made at least one well-formed call) and, where a call returned a result,
`rate/result_in_answer` (the answer holds the text of one of the results it was given).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from ..rollout.conversation import Conversation, Environment
from ..rollout.limits import StepTimeout, await_limited, check_time_limit, maybe_await
from ..types import Message
from .parser import HermesParser, ToolCall, ToolCallParser
from .pool import WorkerLimits, WorkerPool, shared_pool
from .tool import Tool, as_tools, reference_of
from .worker import describe, run_call

TOOL_COUNTERS = ("tool_calls", "tool_valid_calls", "tool_errors", "tool_turns")
ISOLATIONS = ("process", "thread")


def check_isolation(tools: Sequence[Tool], isolation: str, where: str) -> None:
    """ValueError naming `where` unless `isolation` is known and every tool can run under it."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"{where}: isolation must be one of {list(ISOLATIONS)}, got {isolation!r}")
    for tool in tools:
        if isolation == "process" and tool.reference is None:
            why = reference_of(tool.fn)[1]
            raise ValueError(
                f"{where}: tool {tool.name!r} cannot run in a worker process, which imports a tool by "
                f"module and name: {why}. Define it at the top level of a module, or pass "
                "isolation='thread' to run tools in this process (without CPU and memory limits, "
                "and a tool that holds the GIL then stalls the rank)"
            )


def start_workers(tools: Sequence[Tool], limits: WorkerLimits) -> WorkerPool:
    """The pool that runs `tools` under `limits`, its workers importing their modules from now."""
    pool = shared_pool(limits)
    pool.prepare({t.reference.partition(":")[0] for t in tools if t.reference is not None})
    return pool


class ToolEnvironment(Environment):
    """Runs `tools` for the policy seat `policy`; hands other replies to `inner`.

    `inner=None` makes a tools-only lineup: a reply without tool calls ends the conversation.
    A turn that raises (its tools' machinery or the environment it wraps) fails its
    conversation with the cause "tool".
    """

    kind = "tool"

    def __init__(
        self,
        tools: Sequence[Tool],
        inner: Environment | None = None,
        *,
        policy: str = "policy",
        parser: ToolCallParser | None = None,
        max_calls: int = 4,
        tool_timeout_s: float | None = 10.0,
        max_result_chars: int = 2000,
        isolation: str = "process",
        worker_limits: WorkerLimits | None = None,
    ):
        if max_calls < 0:
            raise ValueError(f"ToolEnvironment.max_calls must be >= 0, got {max_calls}")
        check_time_limit(tool_timeout_s, "ToolEnvironment.tool_timeout_s")
        described = as_tools(tools)
        check_isolation(described, isolation, "ToolEnvironment")
        self.tools = {t.name: t for t in described}
        self.isolation = isolation
        self._pool = (
            start_workers(described, worker_limits or WorkerLimits()) if isolation == "process" else None
        )
        if self._pool is not None:  # here, not in the first step: start-up is no step's time
            self._pool.wait_ready()
        self.inner, self.policy, self.parser = inner, policy, parser or HermesParser()
        self.max_calls, self.tool_timeout_s = max_calls, tool_timeout_s
        self.max_result_chars = max_result_chars
        self.name = inner.name if inner is not None else "tools"
        self.role = inner.role if inner is not None else "user"
        self.timeout_s = inner.timeout_s if inner is not None else None
        self._serial = asyncio.Lock()
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    def signature(self) -> tuple:
        inner = self.inner.signature() if self.inner is not None else ()
        return ("tools", self.name, tuple(sorted(self.tools)), inner)

    async def respond(self, conv: Conversation) -> object:
        for key in TOOL_COUNTERS:
            conv.infos.setdefault(key, 0)
        last = conv.messages[-1] if conv.messages else None
        if last is not None and last.speaker == self.policy and conv.infos["tool_calls"] < self.max_calls:
            parsed = self.parser.parse(last.content)
            if parsed.attempted:
                return await self._run(conv, parsed.calls, parsed.errors)
        if last is not None and last.speaker == self.policy:
            self._rate_answer(conv, last.content)
        if self.inner is None:
            if last is not None and last.speaker == self.policy:
                conv.request_stop("answered")
            return None
        return await maybe_await(self.inner.respond(conv))

    def _rate_answer(self, conv: Conversation, answer: str) -> None:
        """The rates of the reply that answers (see the module docstring)."""
        conv.infos["rate/valid_call"] = float(conv.infos["tool_valid_calls"] > 0)
        results = [
            line.strip()
            for m in conv.messages
            if m.role == "tool" and m.speaker == self.name
            for line in m.content.splitlines()
            if line.strip() and not line.startswith(("error: ", "(tool call limit"))
        ]
        if results:
            conv.infos["rate/result_in_answer"] = float(any(r in answer for r in results))

    async def _run(self, conv: Conversation, calls: Sequence[ToolCall], errors: Sequence[str]) -> Message:
        room = self.max_calls - conv.infos["tool_calls"]
        lines = [f"error: {e}" for e in errors[:room]]
        conv.infos["tool_calls"] += len(lines)
        conv.infos["tool_errors"] += len(lines)
        conv.infos["tool_turns"] += 1
        for call in calls[: max(room - len(lines), 0)]:
            conv.infos["tool_calls"] += 1
            ok, text = await self._call(call)
            conv.infos["tool_valid_calls"] += int(ok is not None)
            conv.infos["tool_errors"] += int(not ok)
            lines.append(text if ok else f"error: {text}")
        if conv.infos["tool_calls"] >= self.max_calls:
            lines.append(f"(tool call limit of {self.max_calls} reached: answer now)")
        text = "\n".join(lines)
        if len(text) > self.max_result_chars:
            text = text[: self.max_result_chars] + f"... ({len(text) - self.max_result_chars} characters cut)"
        return Message(speaker=self.name, content=text, role="tool")

    async def _call(self, call: ToolCall) -> tuple[bool | None, str]:
        """(True, result) on success; (False, why) if the tool failed; (None, why) if not callable."""
        tool = self.tools.get(call.name)
        if tool is None:
            return None, f"unknown tool {call.name!r}; the tools are {sorted(self.tools)}"
        problem = tool.argument_error(call.arguments)
        if problem is not None:
            return None, problem
        try:
            if self._pool is not None and tool.reference is not None:
                return await self._pool.call(
                    tool.name, tool.reference, call.arguments,
                    timeout_s=self.tool_timeout_s, max_chars=self.max_result_chars,
                )  # fmt: skip
            # in a thread, where whatever the tool raises becomes its (False, text)
            run = functools.partial(run_call, tool.name, tool.fn, call.arguments)
            return await await_limited(run, limit=self.tool_timeout_s, serial=self._lock(), threaded=True)
        except StepTimeout:
            return False, f"tool {call.name!r} ran past {self.tool_timeout_s:g} s"
        except Exception as exc:  # running the call failed: the policy reads it; the step carries on
            return False, f"tool {call.name!r} could not be run: {describe(exc)}"

    def _lock(self) -> asyncio.Lock:
        # co_step runs each round in a fresh event loop: a lock belongs to the loop that made it
        loop = asyncio.get_running_loop()
        if self._lock_loop is not loop:
            self._serial, self._lock_loop = asyncio.Lock(), loop
        return self._serial

    def reward(self, conv: Conversation) -> float | None:
        return self.inner.reward(conv) if self.inner is not None else None

    def reward_for(self, conv: Conversation, participant: str) -> float | None:
        return self.inner.reward_for(conv, participant) if self.inner is not None else None


def tool_metrics(infos: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """`tool/calls_per_sample`, `tool/valid_fraction`, `tool/errors_per_sample`, `turns_per_sample`.

    From trajectories' (or conversations') infos; the valid fraction is over all calls made
    (1.0 when none were made, so a run without calls does not read as all-invalid).
    """
    n = len(infos)
    if n == 0:
        return {}
    total = {k: sum(float(i.get(k, 0)) for i in infos) for k in TOOL_COUNTERS}
    return {
        "tool/calls_per_sample": total["tool_calls"] / n,
        "tool/valid_fraction": total["tool_valid_calls"] / total["tool_calls"]
        if total["tool_calls"]
        else 1.0,
        "tool/errors_per_sample": total["tool_errors"] / n,
        "turns_per_sample": sum(float(i.get("turns", 0)) for i in infos) / n,
    }
