"""Conversations: an ordered lineup of participants, a transcript, and one token-space view
per policy participant.

A policy participant sees its own turns as the assistant and everyone else's as other roles.
Its view grows by appending: its own turns as the exact sampled ids, every other message
rendered once through its chat template when committed. `trajectories()` hands the views to
the trainer unchanged.
"""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..chat import ChatFormat, Tokenizer
from ..engines.base import Engine, SamplingParams, check_temperature
from ..engines.sampler import text_seed
from ..types import (
    Message,
    Status,
    TrainTurns,
    Trajectory,
    TrajectoryInfo,
    TurnTokens,
    assemble,
    check_train_turns,
)
from .stop import StopCondition, ambient_conditions

Hook = Callable[["Conversation", Message], "Message | None"]


class Participant(ABC):
    """A speaker in a lineup. Policies are batched by the runner; the rest speak one by one."""

    name: str

    @property
    def batchable(self) -> bool:
        return False

    @abstractmethod
    def signature(self) -> tuple:
        """Everything that makes two participants at one lineup position non-interchangeable."""


@dataclass(eq=False)
class Policy(Participant):
    """A participant whose turns are sampled by an engine (and trained, if `trainable`)."""

    name: str
    engine: Engine
    tokenizer: Tokenizer
    sampling: SamplingParams = field(default_factory=SamplingParams)
    trainable: bool = True
    train_turns: TrainTurns = "all"  # its turns with loss mask 1: "all", the "last", one bool per turn
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        check_train_turns(self.train_turns, f"Policy {self.name!r}")
        check_temperature(self.sampling.temperature, f"Policy {self.name!r}")
        self.chat = ChatFormat(self.tokenizer)

    @property
    def batchable(self) -> bool:
        return True

    def signature(self) -> tuple:
        # the engine by name: signatures are compared across ranks; co_step makes sure one
        # name means one engine object. The sampling settings whole, whatever fields they have.
        return ("policy", self.name, self.engine.name, repr(self.sampling), self.chat.stop_token_ids)


class Environment(Participant):
    """A participant implemented in Python: an environment, a tool, a user simulator.

    Subclass and implement `respond` (sync or async). Return text, a Message, or None to stay
    silent this turn; call `conv.request_stop(reason)` to end the conversation. A returned
    Message must name this participant as its speaker and carry no token ids (only a policy's
    sampled turns do). Set `timeout_s` to bound each of its turns; a turn that runs past it
    ends the conversation with status TIMEOUT. One instance may serve many conversations: keep
    per-conversation state in `conv.state(self)`, not on the instance::

        class Echo(Environment):
            name = "echo"
            timeout_s = 5.0
            def respond(self, conv):
                return "you said: " + conv.messages[-1].content
    """

    role: str = "user"  # how policies see this participant's messages
    timeout_s: float | None = None  # limit of one turn in seconds; None: co_step's step_timeout_s
    kind: str = "environment"  # what a failed turn's stop reason names as its cause

    @abstractmethod
    def respond(self, conv: Conversation) -> object: ...  # str, Message, None, or awaits one

    def reward(self, conv: Conversation) -> float | None:
        """The environment's reward for a finished conversation, if it gives one."""
        return None

    def reward_for(self, conv: Conversation, participant: str) -> float | None:
        """The reward of one trained seat; override in games where seats score differently.

        Default: `reward(conv)` for every seat (single-policy environments).
        """
        return self.reward(conv)

    def signature(self) -> tuple:
        return ("env", self.name, type(self).__qualname__, self.role)


class Scripted(Environment):
    """Says its lines in order, then stays silent; each conversation hears every line."""

    def __init__(self, name: str, lines: Sequence[str], role: str = "user"):
        self.name, self.lines, self.role = name, list(lines), role

    def respond(self, conv: Conversation) -> str | None:
        state = conv.state(self)
        said = state.get("said", 0)
        if said >= len(self.lines):
            return None
        state["said"] = said + 1
        return self.lines[said]


@dataclass
class View:
    """One policy participant's token-space view of a conversation, growing by appending."""

    token_ids: list[int] = field(default_factory=list)
    own_turns: list[TurnTokens] = field(default_factory=list)  # its sampled, unedited turns
    seen: int = 0  # tokens up to the end of its last turn: what its engine conditioned on or sampled

    def append(self, ids: list[int]) -> None:
        self.token_ids.extend(ids)


# how a policy sees other seats' messages: as anonymous role messages, with a "[name]: "
# prefix on the text, or with the chat template's `name` field
SeatNames = Literal["anonymous", "prefix", "field"]
SEAT_NAMES = ("anonymous", "prefix", "field")


@dataclass(eq=False)
class Conversation:
    """A lineup, an opening transcript, per-conversation stop conditions and hooks.

    Without an `id`, `co_step` names it by its place in the call (`conv0`, `conv1`, ...), so
    its random stream (the `seed`, a hash of the id unless given) never depends on how many
    other conversations the process made.
    """

    lineup: list[Participant]
    prompt: list[Message] = field(default_factory=list)  # opening messages, seen by everyone
    run_until: StopCondition | Sequence[StopCondition] | None = None
    hooks: list[Hook] = field(default_factory=list)
    id: str = ""
    seed: int | None = None  # this conversation's random stream; defaults to a hash of `id`
    group: int = 0  # prompt index for group advantages
    infos: dict[str, Any] = field(default_factory=dict)
    seat_names: SeatNames = "anonymous"  # how other seats' messages are rendered to a policy

    messages: list[Message] = field(default_factory=list, init=False)
    turns_taken: int = field(default=0, init=False)
    status: Status = field(default=Status.RUNNING, init=False)
    stop_reason: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.lineup:
            raise ValueError(f"conversation {self.id!r}: lineup must name at least one participant")
        names = [p.name for p in self.lineup]
        if len(set(names)) != len(names):
            raise ValueError(f"conversation {self.id!r}: lineup names must be unique, got {names}")
        if self.seat_names not in SEAT_NAMES:
            raise ValueError(
                f"conversation {self.id!r}: seat_names must be one of {SEAT_NAMES}, got {self.seat_names!r}"
            )
        if self.seat_names == "field":
            self._check_name_field()
        own = self.run_until
        own = [] if own is None else [own] if isinstance(own, StopCondition) else list(own)
        for c in own:
            if not isinstance(c, StopCondition):
                raise ValueError(f"conversation {self.id!r}: run_until holds {type(c).__name__}")
        self._own_stops = own
        self._stop_sources: list[StopCondition] = []  # the conditions cloned into _stops, as given
        self._stops: list[StopCondition] | None = None
        self._stop_requested: str | None = None
        self._state: dict[str, dict[str, Any]] = {}
        self.views: dict[str, View] = {}
        self._stepping = False  # a co_step call holds it (see `claim`)

    def _check_name_field(self) -> None:
        for p in self.policies():
            if not p.chat.renders_names:
                raise ValueError(
                    f"conversation {self.id!r}: seat_names='field' puts each speaker's name in the chat "
                    f"template's `name` field, but the template of policy {p.name!r} (tokenizer "
                    f"{p.tokenizer.name_or_path!r}) does not render one and would drop the names; use "
                    "seat_names='prefix' (a '[name]: ' prefix on the text) or 'anonymous'"
                )

    # -- set-up -----------------------------------------------------------------------------
    def start(self, default_id: str = "conv0") -> None:
        """Name and seed it, clone the stop conditions (own + ambient, each once) and render
        the opening views. A later call (a later chunk of turns) adds the ambient conditions
        it has not seen yet: a `stop_when` around a later `co_step` holds from there on."""
        if self._stops is None:
            self._open(default_id)
            self._add_stops(self._own_stops)
        self._add_stops(ambient_conditions())

    def _open(self, default_id: str) -> None:
        self.id = self.id or default_id
        if self.seed is None:
            self.seed = text_seed(self.id)
        for p in self.policies():
            view = View()
            opening = [{"role": "system", "content": p.system_prompt}] if p.system_prompt else []
            opening += [{"role": m.role, "content": m.content} for m in self.prompt]
            if opening:
                view.append(p.chat.conversation_ids(opening))
            self.views[p.name] = view

    def _add_stops(self, conditions: Sequence[StopCondition]) -> None:
        """Add a clone of each condition not added yet (conditions are told apart by object)."""
        new: list[StopCondition] = []
        for c in conditions:
            if not any(c is s for s in [*self._stop_sources, *new]):
                new.append(c)
        clones = [self._clone(c) for c in new]  # all or none: a failed clone adds nothing
        self._stop_sources += new
        self._stops = [*(self._stops or []), *clones]
        # one that already holds (MaxTurns(4) added after 6 turns) ends it before another turn
        fired = [type(s).__name__ for s in clones if s.should_stop(self)]
        if fired and not self.finished:
            self._finish(Status.STOPPED, fired[0])

    def _clone(self, condition: StopCondition) -> StopCondition:
        try:
            return condition.clone()
        except Exception as exc:  # e.g. deepcopy of a lock: name what cannot be copied
            raise ValueError(
                f"conversation {self.id}: stop condition {type(condition).__name__} cannot be cloned "
                f"({type(exc).__name__}: {exc}); every conversation needs its own copy: override "
                "clone() to build a fresh one"
            ) from exc

    def policies(self) -> list[Policy]:
        return [p for p in self.lineup if isinstance(p, Policy)]

    def state(self, participant: Participant) -> dict[str, Any]:
        """Scratch space of one participant in this conversation only (e.g. lines said so far)."""
        return self._state.setdefault(participant.name, {})

    # -- schedule ---------------------------------------------------------------------------
    @property
    def speaker(self) -> Participant:
        return self.lineup[self.turns_taken % len(self.lineup)]

    @property
    def finished(self) -> bool:
        return self.status is not Status.RUNNING

    def request_stop(self, reason: str = "requested") -> None:
        """End the conversation after the current turn (e.g. from a tool or a hook)."""
        self._stop_requested = reason

    def token_cap(self) -> int | None:
        caps = [c for c in (s.token_cap(self) for s in self._stops or []) if c is not None]
        return min(caps) if caps else None

    def prompt_ids(self, policy: Policy) -> list[int]:
        """What the engine conditions on for this policy's next turn."""
        # a view nothing opened yet (no system prompt, no prompt messages) opens with this turn
        opened = self.views[policy.name].token_ids or policy.chat.preamble_ids("assistant")
        return opened + policy.chat.generation_prompt_ids()

    # -- committing a turn ------------------------------------------------------------------
    def commit(self, speaker: Participant, message: Message | None, generated: int = 0) -> None:
        """Run hooks, append the message to the transcript and every view, update stops."""
        if message is not None:
            self._check_message(speaker, message, f"participant {speaker.name!r} returned")
        sampled = message if isinstance(speaker, Policy) and message is not None else None
        for hook in self.hooks:
            if message is None:
                break
            source = f"hook {getattr(hook, '__name__', hook)!r}"
            # each hook edits a copy: an in-place edit is then an edit like any other
            copy = dataclasses.replace(
                message,
                token_ids=None if message.token_ids is None else list(message.token_ids),
                logprobs=None if message.logprobs is None else list(message.logprobs),
            )
            try:
                out = hook(self, copy)
            except Exception as exc:
                exc.add_note(f"conversation {self.id}: {source} raised")
                raise
            if out is not None and not isinstance(out, Message):
                raise ValueError(
                    f"conversation {self.id}: {source} returned {type(out).__name__}; "
                    "expected a Message (keep or edit) or None (drop)"
                )
            if out is not None:
                self._check_message(speaker, out, f"{source} returned")
                if sampled is not None:
                    self._check_sampled(sampled, out, source)
            message = out
        if message is not None:
            self.messages.append(message)
            for p in self.policies():
                self._append_to_view(p, message)
        self.turns_taken += 1
        for s in self._stops or []:
            s.observe(self, message, generated)
        if self._stop_requested is not None:
            self._finish(Status.STOPPED, self._stop_requested)
        else:
            fired = [type(s).__name__ for s in self._stops or [] if s.should_stop(self)]
            if fired:
                self._finish(Status.STOPPED, fired[0])

    def _check_sampled(self, sampled: Message, out: Message, source: str) -> None:
        """A hook may edit a policy turn's text (then it is rendered, not trained), never its ids.

        Ids or logprobs the engine did not produce would be trained under loss mask 1.
        """
        if out.token_ids is not None and (
            out.token_ids != sampled.token_ids or out.logprobs != sampled.logprobs
        ):
            raise ValueError(
                f"conversation {self.id}: {source} returned token_ids/logprobs the engine did not "
                "sample; edit the content (it is rendered as text and not trained) or keep the ids"
            )
        out.edited = out.edited or out.content != sampled.content

    def _check_message(self, speaker: Participant, m: Message, source: str) -> None:
        """A message may only speak for its own speaker, and only a policy's may carry ids.

        `_append_to_view` trains a message's token ids when its speaker is the policy, so an
        environment (or a hook) that named a policy as speaker, or attached ids, would put
        tokens the engine never sampled under loss mask 1.
        """
        where = f"conversation {self.id}: {source} a Message"
        if m.speaker != speaker.name:
            raise ValueError(f"{where} with speaker {m.speaker!r}; expected its own name {speaker.name!r}")
        if not isinstance(m.role, str) or not m.role:
            raise ValueError(f"{where} with role {m.role!r}; expected a non-empty str")
        if not isinstance(speaker, Policy) and (m.token_ids is not None or m.logprobs is not None):
            raise ValueError(
                f"{where} with token_ids/logprobs; expected none: only a policy's sampled turns "
                "carry them (return the text and it is rendered through the chat template)"
            )

    def _append_to_view(self, p: Policy, m: Message) -> None:
        view = self.views[p.name]
        role = "assistant" if m.speaker == p.name else "user" if m.role == "assistant" else m.role
        if not view.token_ids:
            # the first message of the view: what the template puts before a conversation's
            # first message (a default system block) goes first, as `start` does for a prompt
            view.append(p.chat.preamble_ids(role))
        if m.speaker == p.name and m.token_ids is not None and not m.edited:
            # the turn's span opens with the assistant opener (mask 0), then the sampled ids
            opener, start = p.chat.generation_prompt_ids(), len(view.token_ids)
            view.append(opener + list(m.token_ids))
            view.seen = len(view.token_ids)
            mask = [0] * len(opener) + [1] * len(m.token_ids)
            view.own_turns.append(
                TurnTokens(start=start, mask=mask, logprobs=m.logprobs, finish_reason=m.finish_reason)
            )
            # a turn that ended at a stop string (or a policy's own stop id) has no end-of-turn
            # token yet: the template's whole tail closes it, as after a cut-off turn
            closed = bool(m.token_ids) and m.token_ids[-1] in p.chat.stop_token_ids
            view.append(p.chat.close_ids("stop" if closed else "length"))
        elif m.speaker == p.name:  # edited or injected: rendered text, not sampled, never trained
            view.seen = len(view.token_ids)  # the engine sampled ids that the view does not hold
            view.append(p.chat.message_ids("assistant", m.content))
        else:
            if self.seat_names == "prefix":
                view.append(p.chat.message_ids(role, f"[{m.speaker}]: {m.content}"))
            else:
                name = m.speaker if self.seat_names == "field" else None
                view.append(p.chat.message_ids(role, m.content, name=name))

    def _finish(self, status: Status, reason: str) -> None:
        self.status, self.stop_reason = status, reason

    def end(self, status: Status, reason: str) -> None:
        """Mark the conversation finished by the runner (context outgrown, failure, timeout)."""
        if not self.finished:
            self._finish(status, reason)

    # -- output -----------------------------------------------------------------------------
    def engine_view(self, policy: Policy) -> list[int]:
        """The policy's view as its engine saw it: whole while the engine could still condition
        on all of it (its next prompt leaves room in the context), else up to the end of its
        last turn. A message that outgrew the context, or the closing tokens of a turn the
        context cut, were never seen by the engine and must not reach the training forward
        (which would also run past the context's positions)."""
        view = self.views[policy.name]
        if len(self.prompt_ids(policy)) < policy.engine.max_context:
            return list(view.token_ids)
        return view.token_ids[: view.seen]

    def trajectories(self) -> list[Trajectory]:
        """One trajectory per trainable policy participant, in lineup order (`engine_view`)."""
        return [
            assemble(
                self.engine_view(p),
                self.views[p.name].own_turns,
                train=p.train_turns,
                participant=p.name,
                group=self.group,
                status=self.status,
                infos=TrajectoryInfo(
                    conversation=self.id,
                    seed=self.seed,
                    turns=self.turns_taken,
                    stop_reason=self.stop_reason,
                    extra=TrajectoryInfo.split(self.infos),
                ),
            )
            for p in self.policies()
            if p.trainable
        ]


_CLAIMS = threading.Lock()  # claims are checked and taken at once, also across threads


def claim(convs: Sequence[Conversation], where: str) -> list[Conversation]:
    """Mark `convs` as being stepped by one call; a conversation another call is stepping is an
    error (two calls would interleave its turns and views). Release with `release`."""
    with _CLAIMS:
        for i, c in enumerate(convs):
            if c._stepping:
                raise ValueError(
                    f"{where}: conversation {c.id or f'convs[{i}]'!r} is already being stepped by another "
                    "co_step call; a conversation can take part in one call at a time (await the first)"
                )
        for c in convs:
            c._stepping = True
    return list(convs)


def release(convs: Sequence[Conversation]) -> None:
    with _CLAIMS:
        for c in convs:
            c._stepping = False
