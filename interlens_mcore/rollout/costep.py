"""Lockstep co-stepping: every round each active conversation takes one turn; the policy turns
of conversations whose current speakers are interchangeable (same engine, sampling settings
and seat) are generated together in left-padded waves, whatever else their lineups hold.

Example::

    convs = [Conversation([policy, GuessEnv(secret)], prompt, run_until=MaxTurns(8))
             for secret in secrets]
    co_step(convs, turns=None, max_batch_size=32, group_seed=step)
    trajectories = [t for c in convs for t in c.trajectories()]
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ..engines.base import Engine, Generation, GenerationRequest
from ..engines.sampler import mix_seed
from ..types import Message, Status
from .conversation import Conversation, Environment, Policy, claim, release
from .limits import StepTimeout, await_limited, check_time_limit
from .outcome import (
    OnSampleError,
    Room,
    SampleErrors,
    check_on_sample_error,
    fail,
    labelled,
    prompt_fills,
    time_out,
    truncate,
    turn_fills,
)
from .round import (
    Call,
    Driver,
    Need,
    Slices,
    each,
    engine_registry,
    generate_waves,
    key_of,
    no_running_loop,
    run_rounds,
    settle,
)
from .vote import GatherFn, local_gather

DEFAULT_MAX_ROUNDS = 1000


def schedule_signature(conv: Conversation, turns: int | None) -> tuple:
    """Who speaks in the next `turns` turns (the whole lineup cycle when None), as signatures.

    Conversations with equal signatures have interchangeable speakers at every round. `co_step`
    needs less: it batches by the current speaker's signature alone, round by round.
    """
    n = len(conv.lineup)
    span = n if turns is None else turns
    return tuple(conv.lineup[(conv.turns_taken + k) % n].signature() for k in range(span))


@dataclass
class _Row:
    conv: Conversation
    policy: Policy  # the conversation's speaker when the row was made
    request: GenerationRequest
    room: Room  # new tokens the engine's context leaves; the turn ends TRUNCATED if it fills it
    cap: int  # the turn's own token cap


@dataclass
class _Lineup:
    """A conversation as `outcome` ends it: the reason labelled as its stop reason."""

    conv: Conversation

    def end(self, status: Status, reason: str) -> None:
        self.conv.end(status, labelled(status, reason))


class _CoStep(Driver):
    """co_step's half of the lockstep round: Python turns, then rows per speaker signature."""

    def __init__(
        self,
        convs,
        turns,
        max_batch_size,
        group_seed,
        registry,
        step_timeout_s,
        max_rounds,
        errors,
        overlap=1,
    ):
        self.convs, self.turns, self.max_batch_size = convs, turns, max_batch_size
        self.group_seed, self.registry, self.step_timeout_s = group_seed, registry, step_timeout_s
        self.max_rounds = max_rounds
        self.errors: SampleErrors = errors  # one conversation's failure: raised, or kept on it
        self.serial = asyncio.Lock()  # sync responds run one at a time
        # a conversation's own turn limit: `turns` more than it had on entry
        self.limit = {id(c): c.turns_taken + turns for c in convs} if turns is not None else {}
        self.rows: dict[str, list[_Row]] = {}
        # overlap: the conversations in `overlap` slices taking rounds in turn; while the engine
        # generates one slice's turns, the other slices' environment and tool turns run
        self.slices = [convs[s::overlap] for s in range(overlap)]
        self.slicing = Slices(overlap)

    def open(self, c: Conversation) -> bool:
        return not c.finished and (self.turns is None or c.turns_taken < self.limit[id(c)])

    def busy(self) -> bool:
        # a slice whose turn it is not may still have work: every rank keeps voting while it does
        return self.slicing.on and any(self.open(c) for c in self.convs)

    async def local(self) -> dict[str, Need]:
        s = self.slicing.next()
        # with overlap most started while the engine generated another slice's turns
        await self.slicing.run(s, lambda: self._python_turns(self.slices[s]))
        self.rows = defaultdict(list)
        for c in self.slices[s]:
            if self.open(c) and isinstance(c.speaker, Policy):
                row = self._row(c, c.speaker)
                if row is not None:
                    self.rows[key_of(c.speaker.signature())].append(row)
        return {k: Need(engine=rows[0].policy.engine.name, rows=len(rows)) for k, rows in self.rows.items()}

    async def _python_turns(self, convs: list[Conversation]) -> None:
        # environment / tool turns first, so the vote sees who will generate; one vote per
        # policy round, not per turn: Python turns need no collective
        for _ in range(self.max_rounds):
            waiting = [c for c in convs if self.open(c) and not isinstance(c.speaker, Policy)]
            if not waiting:
                return
            errors: list[Exception] = []
            await settle(waiting, self._python_turn, _fail_turn, errors)
            self.errors.settle(errors)
        left = [c.id for c in convs if self.open(c)][:5]
        raise RuntimeError(
            f"co_step: conversations {left} took {self.max_rounds} turns without a policy turn or "
            "a stop; give them stop conditions (run_until, stop_when) or pass turns"
        )

    def _row(self, c: Conversation, p: Policy) -> _Row | None:
        prompt, engine = c.prompt_ids(p), p.engine
        room = Room.after(len(prompt), engine.max_context)
        if not room.fits:  # this conversation alone ends; its earlier turns stay
            truncate(_Lineup(c), prompt_fills(len(prompt), engine.name, engine.max_context))
            return None
        assert c.seed is not None, "Conversation.start() seeds every conversation"
        cap = c.token_cap()
        cap = p.sampling.max_new_tokens if cap is None else min(cap, p.sampling.max_new_tokens)
        # every sampling option of the policy (top-p/k, penalties, stop strings and ids) rides along
        request = p.sampling.request(
            prompt,
            max_new_tokens=room.budget(cap),
            seed=mix_seed(self.group_seed, c.seed, c.turns_taken, c.lineup.index(p)),
            stop_token_ids=p.chat.stop_token_ids,
            tag=c.id,
        )
        return _Row(c, p, request, room, cap)

    async def _python_turn(self, c: Conversation) -> None:
        speaker: Environment = c.speaker  # type: ignore[assignment]
        limit = speaker.timeout_s if speaker.timeout_s is not None else self.step_timeout_s
        try:
            out = await await_limited(speaker.respond, c, limit=limit, serial=self.serial)
        except StepTimeout:
            time_out(_Lineup(c), speaker.name, limit, c.turns_taken + 1)
            return
        if out is None or isinstance(out, Message):
            msg = out
        elif isinstance(out, str):
            msg = Message(speaker=speaker.name, content=out, role=speaker.role)
        else:
            raise ValueError(
                f"conversation {c.id}: participant {speaker.name!r} returned "
                f"{type(out).__name__}; expected str, Message or None"
            )
        c.commit(speaker, msg)

    def over_bound(self, rounds: int) -> Exception:
        left = [c.id for c in self.convs if self.open(c)][:5]
        return RuntimeError(
            f"co_step(turns=None): conversations {left} still running after {rounds} rounds; "
            "give them stop conditions (run_until, stop_when) or pass turns"
        )

    def holds(self) -> list[str]:
        return list(self.registry)

    def unheld(self, engine: str, callers: list[int]) -> str:
        return (
            f"co_step: ranks {callers} generate with engine {engine!r}, which this rank does not "
            "hold (it has no conversation that uses it); pass it in co_step(engines=...) on every rank"
        )

    def call(self, calls: list[Call]) -> None:
        """Every aligned call, in key order; a failed one does not skip the later collectives."""
        errors = []
        for call in calls:
            try:
                self._generate(call)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    async def call_async(self, calls: list[Call]) -> None:
        # the other slices' environment and tool turns run while the engine generates here; each
        # slice's next round waits for its own
        self.slicing.start_others(
            lambda t: any(self.open(c) for c in self.slices[t]), lambda t: self._python_turns(self.slices[t])
        )
        self.call(calls)

    def _generate(self, call: Call) -> None:
        engine = self.registry[call.engine]  # every rank holds it: run_rounds checked the ballots
        rows = self.rows.get(call.key, [])
        results = generate_waves(engine, [r.request for r in rows], call, self.max_batch_size)
        self._commit_all(rows, results)

    def _commit_all(self, rows: list[_Row], results: list[Generation]) -> None:
        # each conversation commits on its own: a failing hook fails only its conversation
        errors: list[Exception] = []
        each(list(zip(rows, results, strict=True)), _commit, lambda rg, exc: _fail(rg[0].conv, exc), errors)
        self.errors.settle(errors)


def _commit(row_gen: tuple[_Row, Generation]) -> None:
    row, gen = row_gen
    c, p = row.conv, row.policy
    msg = Message(
        speaker=p.name,
        content=p.chat.decode(gen.token_ids),
        role="assistant",
        token_ids=list(gen.token_ids),
        logprobs=list(gen.logprobs),
        finish_reason=gen.finish_reason,
    )
    c.commit(p, msg, generated=len(gen.token_ids))
    if row.room.filled(len(gen.token_ids), row.cap):  # the turn was cut by the context, not by its cap
        truncate(_Lineup(c), turn_fills(c.turns_taken, p.engine.name, p.engine.max_context))


def _fail(c: Conversation, exc: Exception, what: str = "hook") -> None:
    """End `c` FAILED: `what` failed, by default a hook of a policy turn's commit (the task's code)."""
    fail(_Lineup(c), exc, what=what, note=f"conversation {c.id}", known=c.id)


def _fail_turn(c: Conversation, exc: Exception) -> None:
    """An environment's or tool's turn raised or returned something that is no message."""
    speaker = c.speaker
    _fail(c, exc, speaker.kind if isinstance(speaker, Environment) else "environment")


def _check_args(convs, turns, max_batch_size, max_rounds, step_timeout_s, on_sample_error, overlap) -> None:
    check_on_sample_error(on_sample_error, "co_step: on_sample_error")
    if not isinstance(overlap, int) or isinstance(overlap, bool) or overlap < 1:
        raise ValueError(f"co_step: overlap must be an int >= 1 (1: no overlap), got {overlap!r}")
    if turns is not None and (not isinstance(turns, int) or turns < 0):
        raise ValueError(f"co_step: turns must be an int >= 0 or None, got {turns!r}")
    if not isinstance(max_rounds, int) or isinstance(max_rounds, bool) or max_rounds < 1:
        raise ValueError(f"co_step: max_rounds must be an int >= 1, got {max_rounds!r}")
    check_time_limit(step_timeout_s, "co_step: step_timeout_s")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"co_step: max_batch_size must be >= 1 or None, got {max_batch_size}")
    seen: set[int] = set()
    for i, c in enumerate(convs):
        if not isinstance(c, Conversation):
            raise ValueError(f"co_step: convs[{i}] must be a Conversation, got {type(c).__name__}")
        if id(c) in seen:  # its rows would be generated twice and committed as the next speaker's
            raise ValueError(
                f"co_step: conversation {c.id or i!r} is passed twice (convs[{i}]); pass each once"
            )
        seen.add(id(c))


def _start(convs: list[Conversation], engines: Sequence[Engine]) -> dict[str, Engine]:
    for i, c in enumerate(convs):
        c.start(default_id=f"conv{i}")
    twice = sorted(k for k, n in Counter(c.id for c in convs).items() if n > 1)
    if twice:
        raise ValueError(
            f"co_step: conversation ids {twice} are not unique; ids tag engine rows and seed samples"
        )
    for c in convs:
        for p in c.lineup:
            if isinstance(p, Environment):
                check_time_limit(p.timeout_s, f"conversation {c.id}: participant {p.name!r} timeout_s")
    return engine_registry([*engines, *(p.engine for c in convs for p in c.policies())], "co_step")


async def co_step_async(
    convs: Sequence[Conversation],
    turns: int | None = None,
    *,
    max_batch_size: int | None = None,
    group_seed: int = 0,
    gather_fn: GatherFn = local_gather,
    rank: int = 0,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    engines: Sequence[Engine] = (),
    step_timeout_s: float | None = None,
    on_sample_error: OnSampleError = "raise",
    overlap: int = 1,
) -> list[Conversation]:
    """`co_step` for callers inside a running event loop (a notebook, an async server)."""
    convs = list(convs)
    error, registry, claimed = None, {}, []
    try:
        _check_args(convs, turns, max_batch_size, max_rounds, step_timeout_s, on_sample_error, overlap)
        claimed = claim(convs, "co_step")  # before `start`, which may change a claimed one
        registry = _start(convs, engines)
    except Exception as exc:  # carried in the first vote, so every rank fails alike
        error, convs = exc, []
    errors = SampleErrors(on_sample_error)
    overlap = overlap if error is None else 1
    driver = _CoStep(
        convs, turns, max_batch_size, group_seed, registry, step_timeout_s, max_rounds, errors, overlap
    )
    try:
        # with `turns`, every round takes a policy turn of every open conversation: no bound needed;
        # with overlap, a slice takes every overlap-th round
        bound = max_rounds * overlap if turns is None else None
        await run_rounds(driver, gather_fn=gather_fn, rank=rank, bound=bound, error=error)
    finally:
        driver.slicing.close()
        release(claimed)
    return convs


def co_step(
    convs: Sequence[Conversation],
    turns: int | None = None,
    *,
    max_batch_size: int | None = None,
    group_seed: int = 0,
    gather_fn: GatherFn = local_gather,
    rank: int = 0,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    engines: Sequence[Engine] = (),
    step_timeout_s: float | None = None,
    on_sample_error: OnSampleError = "raise",
    overlap: int = 1,
) -> list[Conversation]:
    """Advance every conversation by `turns` turns, or until its stop conditions fire (None).

    A round is one policy turn of every active conversation, batched by the current speaker
    (engine, sampling settings, seat); the environment, tool and scripted turns in between
    run before it. With `turns`, conversations still running after their `turns` turns stay
    RUNNING: a later `co_step` continues them. Conversations are told apart by object (each
    at most once per call, and in one call at a time: one that another `co_step_async` is
    stepping is refused) and by id (unique); engines by object, their names aligning calls
    across ranks (two different engines with one name are an error). A conversation whose
    prompt outgrows its engine's context, or whose turn is cut by it, ends alone with status
    TRUNCATED, its earlier turns kept; its trajectories end where the engine's last sampled
    token does (`Conversation.engine_view`).

    With a distributed `gather_fn` (`distributed.build_groups(...).gather_fn()`) the ranks vote
    before each round; a rank with nothing left joins every engine call with an empty batch
    while any rank works, and a failure on one rank raises the same RolloutError on all of
    them. `engines` names engines a rank must be able to join even if it holds no
    conversation that uses them; a call that some rank cannot join raises the same
    `RolloutValueError` on every rank before the call. A failure (a raising hook or
    environment, bad output) marks its own conversation FAILED, naming it, its stop reason
    "<what>: <ExcType>: <text>" (what: environment, tool, hook); the others keep the turns they
    made. With `on_sample_error="raise"` (default) that failure then fails the rollout on every
    rank; with "skip" the others carry on to their ends and nothing is raised. Failures that are
    not one conversation's (an engine call, the vote, bad arguments) always fail the rollout.

    `overlap` > 1 splits the conversations into that many slices (every overlap-th one) that
    take rounds in turn: while the engine generates one slice's policy turns on the calling
    thread, the other slices' environment and tool turns run on an event loop in a helper
    thread (every environment turn runs there then, so an environment must not rely on being
    on the main thread, e.g. for signals). A conversation's turns, seeds and tokens are the same as
    without overlap (rows are seeded per conversation and the engines' tokens do not depend on
    the batch); each round votes as before, one slice at a time. It pays off when environment
    or tool turns take about as long as a round's generation; with instant environments it
    only adds rounds.

    `step_timeout_s` limits every environment / tool / scripted turn (an `Environment`'s own
    `timeout_s` wins). A turn past its limit ends that conversation with status TIMEOUT and
    commits nothing; its trajectories keep the turns before it, and the others carry on (it
    is not a failure). An async `respond` is cancelled at the limit; a sync one runs in a
    daemon thread, one at a time, and, as a thread cannot be killed, may finish later: what
    it returns is discarded, but it still runs, so it should not keep mutating the
    conversation. Without any limit sync responds run inline. Inside a running event loop,
    `await co_step_async(...)` instead.
    """
    no_running_loop("co_step")
    return asyncio.run(co_step_async(**locals()))  # every argument, by name
