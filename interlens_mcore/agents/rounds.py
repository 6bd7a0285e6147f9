"""Black-box agents in lockstep rounds: every live agent's calls go into one engine call.

A rollout runs one agent per sample, each against its own session of this rank's endpoint.
The agents are opaque (any code that speaks the OpenAI API), so a round cannot ask them what
they need; it waits for them instead. A round's local phase ends when every live agent is
waiting on the endpoint or has finished, or when `round_wait_s` has passed with no agent
calling or finishing (an agent busy with a slow tool then joins a later round). Then the
round goes through `run_rounds` as `co_step`'s do: the vote (is any rank still working, did
any rank fail), then one aligned engine call in waves, every rank alike, a rank with no
waiting agent taking part with no rows. So ranks whose agents make different numbers of
calls never deadlock, and one rank's failure is every rank's error.

An agent that neither calls nor finishes for `step_timeout_s` is cancelled and its sample
ends TIMEOUT; a sync agent's thread cannot be stopped, so a call it makes later is refused
(409, "session_ended") and reaches neither the engine nor the sample's tokens. An agent that
raises ends its sample FAILED ("agent: <ExcType>: <text>"); with `on_sample_error="raise"`
its error also fails the rollout on every rank.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engines.base import Engine, Generation, GenerationRequest
from ..rollout.limits import _in_daemon_thread
from ..rollout.outcome import OnSampleError, SampleErrors, failure_reason
from ..rollout.round import Call, Driver, Need, generate_waves
from ..types import Status
from .defaults import ROUND_WAIT_S
from .protocol import BadRequest
from .server import hand_out
from .session import Session

AgentFn = Callable[[Any, Any], Any]  # (client, row) -> reward | dict, sync or async


@dataclass(eq=False)
class AgentRun:
    """One sample's agent: its session, its task and how it ended."""

    session: Session
    start: Callable[[], Coroutine[Any, Any, object]]  # runs the agent to its result
    task: asyncio.Task[object] | None = None
    idle_since: float = field(default_factory=time.monotonic)  # since the endpoint last answered it
    status: Status = Status.RUNNING
    reason: str | None = None
    result: object = None

    @property
    def live(self) -> bool:
        return self.status is Status.RUNNING


class AgentRounds(Driver):
    """The endpoint's `Batcher` during a rollout, and `run_rounds`'s driver (module docstring)."""

    def __init__(
        self,
        engine: Engine,
        runs: Sequence[AgentRun],
        *,
        max_batch_size: int | None = None,
        round_wait_s: float = ROUND_WAIT_S,
        step_timeout_s: float | None = None,
        on_sample_error: OnSampleError = "raise",  # as the other drivers; a rollout passes its own
    ):
        self.engine, self.runs = engine, list(runs)
        self.by_session = {r.session.id: r for r in self.runs}
        self.max_batch_size, self.round_wait_s = max_batch_size, round_wait_s
        self.step_timeout_s = step_timeout_s
        self.errors = SampleErrors(on_sample_error)
        self.engine_calls = 0  # generate calls made (waves), equal on every rank
        self._pending: list[tuple[AgentRun, list[GenerationRequest], asyncio.Future[list[Generation]]]] = []
        self._batch: list[tuple[AgentRun, list[GenerationRequest], asyncio.Future[list[Generation]]]] = []
        self._changed = asyncio.Event()
        self._started = False

    # -- the endpoint's side ------------------------------------------------------------------
    async def generate(self, session: Session, requests: list[GenerationRequest]) -> list[Generation]:
        run = self.by_session[session.id]
        if not run.live:  # a timed-out agent's thread runs on: its sample has ended, calls are refused
            raise BadRequest(
                f"agent session {session.id!r} has ended ({run.reason or run.status.value}); "
                "its calls are no longer answered",
                status=409,
                code="session_ended",
            )
        future: asyncio.Future[list[Generation]] = asyncio.get_running_loop().create_future()
        self._pending.append((run, requests, future))
        self._changed.set()
        try:
            return await future
        finally:
            run.idle_since = time.monotonic()

    # -- the round's side ---------------------------------------------------------------------
    async def local(self) -> dict[str, Need]:
        if not self._started:
            self._started = True
            for run in self.runs:
                run.task = asyncio.create_task(run.start())
                run.task.add_done_callback(lambda _t: self._changed.set())
        await self._settle()
        errors = self._collect()
        self._batch, self._pending = [p for p in self._pending if not p[2].done()], []
        self.errors.settle(errors)  # "raise": the first agent's error goes to the vote
        rows = sum(len(reqs) for _, reqs, _ in self._batch)
        if not rows and not any(r.live for r in self.runs):
            return {}
        return {"agents": Need(engine=self.engine.name, rows=rows)}

    def call(self, calls: list[Call]) -> None:
        requests = [r for _, reqs, _ in self._batch for r in reqs]
        (call,) = calls  # one kind of call: the agents' engine
        waves, _ = call.waves(self.max_batch_size)
        try:
            out = generate_waves(self.engine, requests, call, self.max_batch_size)
        except Exception as exc:
            for _, _, future in self._batch:
                future.set_exception(RuntimeError(f"the engine call failed: {type(exc).__name__}: {exc}"))
            raise
        finally:
            self.engine_calls += waves
        hand_out([(reqs, future) for _, reqs, future in self._batch], out)
        self._batch = []

    async def _settle(self) -> None:
        """Wait until every live agent waits on the endpoint or has finished (or for the grace)."""
        await asyncio.sleep(0)  # agents answered by the last call resume before anything is counted
        while True:
            live = [r for r in self.runs if r.live and not (r.task is not None and r.task.done())]
            held = self._held()
            if all(id(r) in held for r in live):
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=self._wait_for(live))
            except asyncio.TimeoutError:  # no agent called or finished for the grace (or a limit hit)
                self._timed_out(live)
                return

    def _held(self) -> set[int]:
        """The agents waiting: a call held for the next engine call (an answered call does not
        count, though its agent has not resumed yet)."""
        return {id(run) for run, _, future in self._pending if not future.done()}

    def _wait_for(self, live: Sequence[AgentRun]) -> float:
        wait = self.round_wait_s
        if self.step_timeout_s is not None:
            now = time.monotonic()
            held = self._held()
            busy = [self.step_timeout_s - (now - r.idle_since) for r in live if id(r) not in held]
            wait = min([wait, *busy]) if busy else wait
        return max(wait, 0.001)

    def _timed_out(self, live: Sequence[AgentRun]) -> bool:
        """Cancel every agent busy past `step_timeout_s`; True if one was."""
        if self.step_timeout_s is None:
            return False
        now, any_ = time.monotonic(), False
        held = self._held()
        for r in live:
            if id(r) not in held and now - r.idle_since >= self.step_timeout_s and r.task is not None:
                r.task.cancel()
                r.status = Status.TIMEOUT
                r.reason = f"timeout: agent made no call for {self.step_timeout_s:g} s"
                any_ = True
        return any_

    def _collect(self) -> list[Exception]:
        """Record the agents that finished since the last round; their errors, for the vote."""
        errors: list[Exception] = []
        for r in self.runs:
            if r.task is None or not r.task.done() or not r.live:
                continue
            if r.task.cancelled():
                r.status, r.reason = Status.TIMEOUT, r.reason or "timeout: the agent was cancelled"
                continue
            exc = r.task.exception()
            if isinstance(exc, Exception):
                r.status, r.reason = Status.FAILED, failure_reason("agent", exc)
                exc.add_note(f"agent of session {r.session.id}")
                errors.append(exc)
            elif exc is not None:  # KeyboardInterrupt and the like: not one sample's fault
                raise exc
            else:
                r.status, r.result = Status.STOPPED, r.task.result()
        return errors

    def cancel_all(self) -> None:
        for r in self.runs:
            if r.task is not None and not r.task.done():
                r.task.cancel()
        for _, _, future in [*self._pending, *self._batch]:
            if not future.done():
                future.cancel()


def agent_call(
    fn: AgentFn, client_for: Callable[[bool], Any], row: object
) -> Callable[[], Coroutine[Any, Any, object]]:
    """A coroutine factory running `fn(client, row)`: an async fn in the loop with an
    `AsyncOpenAI` client, a sync one in a daemon thread (one that never returns does not keep
    the process alive) with an `OpenAI` client."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):

        async def run_async() -> object:
            return await fn(client_for(True), row)

        return run_async

    async def run_sync() -> object:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()

        def deliver(ok: bool, value: object) -> None:
            def settle() -> None:
                if future.done():
                    return
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value if isinstance(value, BaseException) else RuntimeError(value))

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the rollout is over and its loop closed: nothing waits for it
                pass

        _in_daemon_thread(lambda: fn(client_for(False), row), (), deliver)
        result = await future
        return await result if inspect.isawaitable(result) else result

    return run_sync
