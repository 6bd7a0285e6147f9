"""The lockstep round that both rollout drivers run (`co_step` for lineups, `run_multi_turn` for
schedulers), written once.

Every round has three parts, in the same order on every rank of the rollout group:

1. the local phase: this rank's environment, tool, hook and scheduler code, concurrently (it
   may await I/O), each call under its time limit. One item's failure marks that item and is
   kept for the vote; the other items carry on;
2. the vote (`vote.cast_vote`): is any rank still working, did any rank fail (then every rank
   raises the same `RolloutError`), which engine calls each rank needs, with how many rows,
   and which engines it holds: a call that some rank cannot join is refused on every rank
   before any of them enters it (a colocated engine would wait for the missing rank forever);
3. the engine calls: every rank makes the same calls in the same order (sorted by keys that
   are equal on every rank), an idle rank with no rows, because a colocated engine's forward
   is a collective.

A driver implements `Driver`; `run_rounds` runs it::

    class Once(Driver):
        def __init__(self): self.left = 1
        async def local(self):
            return {"gen": Need(engine="policy", rows=self.left)} if self.left else {}
        def call(self, calls):  # [Call("gen", "policy", rows=[1, ...])], the same on every rank
            self.left = 0
    await run_rounds(Once(), gather_fn=local_gather, rank=0)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..engines.base import Engine, Generation, GenerationRequest
from .vote import Ballot, GatherFn, RolloutValueError, cast_vote

T = TypeVar("T")


@dataclass(frozen=True)
class Need:
    """One engine call a rank needs this round."""

    engine: str  # the engine's name: equal on every rank, so the call can be aligned
    rows: int


@dataclass(frozen=True)
class Call:
    """One aligned engine call of a round: what every rank asked of it, in rank order."""

    key: str
    engine: str
    rows: list[int]  # [ranks] rows each rank brings

    def waves(self, max_batch_size: int | None) -> tuple[int, int]:
        """(waves, width): the same on every rank, so every rank makes as many generate calls."""
        width = max_batch_size or max(self.rows) or 1
        return max(math.ceil(n / width) for n in self.rows), width


class Driver(ABC):
    """One rollout driver's half of the round; `run_rounds` supplies the vote and the order."""

    @abstractmethod
    async def local(self) -> dict[str, Need]:
        """Run the round's local phase; return the engine calls this rank needs, by key."""

    @abstractmethod
    def call(self, calls: list[Call]) -> None:
        """Make the round's engine calls (all ranks get the same `calls`, sorted by key)."""

    async def call_async(self, calls: list[Call]) -> None:
        """`call` for drivers that let other work run while the engine generates (`co_step`'s
        overlap); by default the plain `call`."""
        self.call(calls)

    def busy(self) -> bool:
        """Work left beyond this round's needs (a driver that takes its items in turns): the rank
        votes itself active even in a round where it needs no engine call."""
        return False

    def over_bound(self, rounds: int) -> Exception:
        return RuntimeError(f"rollout still running after {rounds} rounds")

    def holds(self) -> Collection[str] | None:
        """Names of the engines this rank can call; None: it can make every call."""
        return None

    def unheld(self, engine: str, callers: list[int]) -> str:
        """Why this rank cannot join `engine`'s call, which ranks `callers` need."""
        return f"ranks {callers} generate with engine {engine!r}, which this rank does not hold"


def generate_waves(
    engine: Engine, requests: list[GenerationRequest], call: Call, max_batch_size: int | None
) -> list[Generation]:
    """This rank's rows of an aligned call, in as many generate calls as every other rank makes
    (some of them empty); a wave that runs out of memory is split in halves and retried."""
    waves, width = call.waves(max_batch_size)
    out: list[Generation] = []
    for w in range(waves):
        out.extend(_generate_splitting(engine, requests[w * width : (w + 1) * width]))
    if len(out) != len(requests):
        raise ValueError(f"engine {call.engine!r} returned {len(out)} generations for {len(requests)} rows")
    return out


def _generate_splitting(engine: Engine, requests: list[GenerationRequest]) -> list[Generation]:
    try:
        return engine.generate(requests)
    except torch.OutOfMemoryError:
        # rows are independent, so halves give the same tokens; only safe for engines that are
        # not collective: a split on one rank would desync the group
        if len(requests) <= 1:
            raise
        half = len(requests) // 2
        return _generate_splitting(engine, requests[:half]) + _generate_splitting(engine, requests[half:])


class SideLoop:
    """An event loop in a daemon thread of its own, for overlap: the Python turns (environments,
    tools, hooks) of the slices that are not generating run there while the engine generates on
    the calling thread, where torch keeps its own thread pool (a generate call moved to another
    thread ran 1.5 to 2 times slower here: two OpenMP teams on two cores)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="interlens-overlap", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[object, object, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Cancel what still runs there (the rollout failed elsewhere), then stop the thread."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.submit(cancel_all()).result(timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=60)
            if not self.thread.is_alive():
                self.loop.close()


class Slices:
    """Overlap's bookkeeping, for either driver: whose round it is among `k` slices, and their
    local work (Python turns, hooks) on a `SideLoop` beside the engine call (k > 1)."""

    def __init__(self, k: int) -> None:
        self.k, self.rounds, self.current = k, 0, 0
        self.side = SideLoop() if k > 1 else None
        self.pending: dict[int, concurrent.futures.Future] = {}  # started there, not yet awaited

    @property
    def on(self) -> bool:
        return self.side is not None

    def next(self) -> int:
        """The slice whose round begins."""
        self.current = self.rounds % self.k
        self.rounds += 1
        return self.current

    async def run(self, s: int, work: Callable[[], Coroutine[object, object, T]]) -> T:
        """Slice `s`'s local work: started beside the last engine call, or now."""
        if self.side is None:
            return await work()
        started = self.pending.pop(s, None) or self.side.submit(work())
        return await asyncio.wrap_future(started)

    def start_others(
        self, has_work: Callable[[int], bool], work: Callable[[int], Coroutine[object, object, object]]
    ) -> None:
        """Before the engine call: the other slices' local work starts on the side loop."""
        if self.side is None:
            return
        for t in range(self.k):
            if t != self.current and t not in self.pending and has_work(t):
                self.pending[t] = self.side.submit(work(t))

    def close(self) -> None:
        """Cancel what still runs on the side loop (the rollout failed elsewhere) and stop it."""
        self.pending.clear()
        if self.side is not None:
            self.side.close()


def key_of(signature: tuple) -> str:
    """A digest that is the same on every rank (no object ids), used to align engine calls."""
    return hashlib.sha1(repr(signature).encode()).hexdigest()[:16]


def aligned(ballots: Sequence[Ballot]) -> list[Call]:
    """The round's engine calls over every rank's needs, sorted by key."""
    names: dict[str, str] = {}
    for b in ballots:
        for key, (engine, _) in b.payload.get("needs", {}).items():
            names.setdefault(key, engine)
    return [
        Call(key, names[key], [b.payload.get("needs", {}).get(key, ("", 0))[1] for b in ballots])
        for key in sorted(names)
    ]


async def run_rounds(
    driver: Driver,
    *,
    gather_fn: GatherFn,
    rank: int,
    bound: int | None = None,
    error: Exception | None = None,
) -> int:
    """Run rounds until no rank has work; returns the number of rounds that called engines.

    A failure in the local phase or an engine call is voted on before anything else runs, so
    every rank raises the same `RolloutError` (from `cast_vote`) in the same round. `error` is
    a failure from before the first round (bad input found while setting up). With a `bound`,
    a round past it raises `driver.over_bound(bound)` on every rank alike.
    """
    rounds = 0
    while True:
        needs: dict[str, Need] = {}
        if error is None:
            try:
                needs = await driver.local()
            except Exception as exc:
                error = exc
        held = driver.holds()
        payload = {
            "needs": {k: (n.engine, n.rows) for k, n in needs.items()},
            "holds": None if held is None else sorted(held),
        }
        active = error is None and (bool(needs) or driver.busy())
        ballots = cast_vote(gather_fn, rank=rank, active=active, error=error, payload=payload)
        if not any(b.active for b in ballots):
            return rounds
        if bound is not None and rounds >= bound:  # every rank sees the same ballots: all raise
            raise driver.over_bound(bound)
        calls = aligned(ballots)
        check_held(calls, ballots, driver)
        try:
            await driver.call_async(calls)
        except Exception as exc:
            error = exc
        rounds += 1


def check_held(calls: list[Call], ballots: Sequence[Ballot], driver: Driver) -> None:
    """Raise the same RolloutValueError on every rank if a rank cannot join one of `calls`.

    Every rank sees the same ballots, so every rank raises here, before any engine call: a rank
    that found out inside the round would leave the others waiting in the engine's collective
    until the vote timed out.
    """
    failures = []
    for b in ballots:
        held = b.payload.get("holds")
        lacking = [c for c in calls if held is not None and c.engine not in held]
        if lacking:
            call = lacking[0]
            callers = [o.rank for o, n in zip(ballots, call.rows, strict=True) if n]
            failures.append((b.rank, f"ValueError: {driver.unheld(call.engine, callers)}"))
    if failures:
        raise RolloutValueError(failures)


async def settle(
    items: Sequence[T],
    step: Callable[[T], Awaitable[object]],
    fail: Callable[[T, Exception], None],
    errors: list[Exception],
) -> list[T]:
    """Run `step` for every item concurrently; an item whose step raises is `fail`ed and its
    exception added to `errors` (for the vote to carry), the others carry on. Returns the
    items that did not fail."""
    results = await asyncio.gather(*(step(i) for i in items), return_exceptions=True)
    ok = []
    for item, result in zip(items, results, strict=True):
        if isinstance(result, Exception):
            fail(item, result)
            errors.append(result)
        elif isinstance(result, BaseException):  # cancellation, KeyboardInterrupt: not an item's fault
            raise result
        else:
            ok.append(item)
    return ok


def each(
    items: Sequence[T],
    step: Callable[[T], object],
    fail: Callable[[T, Exception], None],
    errors: list[Exception],
) -> list[T]:
    """`settle` for a synchronous step, item by item (e.g. committing a generated turn)."""
    ok = []
    for item in items:
        try:
            step(item)
        except Exception as exc:
            fail(item, exc)
            errors.append(exc)
        else:
            ok.append(item)
    return ok


def raise_first(errors: list[Exception]) -> None:
    """After a phase settled every item: its first failure goes to the vote."""
    if errors:
        raise errors[0]


def engine_registry(engines: Sequence[Engine], where: str) -> dict[str, Engine]:
    """Engines by name, for aligning calls across ranks; an engine is told apart by object.

    Two different engine objects under one name would be indistinguishable on another rank
    (and were once silently merged here): that is an error naming both.
    """
    registry: dict[str, Engine] = {}
    for e in engines:
        prev = registry.setdefault(e.name, e)
        if prev is not e:
            raise ValueError(
                f"{where}: two different engines are named {e.name!r} ({type(prev).__name__} and "
                f"{type(e).__name__}); calls are aligned across ranks by name, so give each engine "
                "its own name (e.g. HFEngine(..., name='frozen'))"
            )
    return registry


def no_running_loop(name: str) -> None:
    """The sync entry points run their own event loop; inside a running one, say what to call."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{name}() was called inside a running event loop; use `await {name}_async(...)`")
