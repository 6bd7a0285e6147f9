"""Conversations: an ordered lineup of participants, a transcript, and one token-space view
per policy participant.

A policy participant sees its own turns as the assistant and everyone else's as other roles.
Its view grows by appending: its own turns as the exact sampled ids, every other message
rendered once through its chat template when committed. `trajectories()` hands the views to
the trainer unchanged.
"""

from __future__ import annotations

import itertools
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .chat import ChatFormat
from .engine import Engine, SamplingParams
from .stop import StopCondition, ambient_conditions
from .trajectory import Message, Status, Trajectory, TurnSpan

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
    tokenizer: Any
    sampling: SamplingParams = field(default_factory=SamplingParams)
    trainable: bool = True
    train_turns: str = "all"  # "all" of its turns carry loss mask 1, or only the "last"
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.train_turns not in ("all", "last"):
            raise ValueError(f"Policy.train_turns must be 'all' or 'last', got {self.train_turns!r}")
        self.chat = ChatFormat(self.tokenizer)

    @property
    def batchable(self) -> bool:
        return True

    def signature(self) -> tuple:
        s = self.sampling
        return ("policy", self.name, self.engine.name, s.temperature, s.max_new_tokens)


class Environment(Participant):
    """A participant implemented in Python: an environment, a tool, a user simulator.

    Subclass and implement `respond` (sync or async). Return text, a Message, or None to stay
    silent this turn; call `conv.request_stop(reason)` to end the conversation. A returned
    Message must name this participant as its speaker and carry no token ids (only a policy's
    sampled turns do). Set `timeout_s` to bound each of its turns; a turn that runs past it
    ends the conversation with status TIMEOUT::

        class Echo(Environment):
            name = "echo"
            timeout_s = 5.0
            def respond(self, conv):
                return "you said: " + conv.messages[-1].content
    """

    role: str = "user"  # how policies see this participant's messages
    timeout_s: float | None = None  # limit of one turn in seconds; None: co_step's step_timeout_s

    @abstractmethod
    def respond(self, conv: Conversation) -> Any: ...

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
    """Says its lines in order, then stays silent."""

    def __init__(self, name: str, lines: Sequence[str], role: str = "user"):
        self.name, self.lines, self.role = name, list(lines), role
        self._said = 0

    def respond(self, conv: Conversation) -> str | None:
        if self._said >= len(self.lines):
            return None
        self._said += 1
        return self.lines[self._said - 1]


@dataclass
class View:
    """One policy participant's token-space view of a conversation."""

    token_ids: list[int] = field(default_factory=list)
    own_turns: list[tuple[int, int, int, list[float], str | None]] = field(default_factory=list)
    # (span start, sampled start, sampled end, logprobs, finish_reason) of each own sampled turn

    def append(self, ids: list[int]) -> None:
        self.token_ids.extend(ids)


_ids = itertools.count()


@dataclass(eq=False)
class Conversation:
    """A lineup, an opening transcript, per-conversation stop conditions and hooks."""

    lineup: list[Participant]
    prompt: list[Message] = field(default_factory=list)  # opening messages, seen by everyone
    run_until: StopCondition | Sequence[StopCondition] | None = None
    hooks: list[Hook] = field(default_factory=list)
    id: str = ""
    seed: int | None = None  # this conversation's random stream; defaults to a hash of `id`
    group: int = 0  # prompt index for group advantages
    infos: dict[str, Any] = field(default_factory=dict)

    messages: list[Message] = field(default_factory=list, init=False)
    turns_taken: int = field(default=0, init=False)
    status: Status = field(default=Status.RUNNING, init=False)
    stop_reason: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.lineup:
            raise ValueError("Conversation.lineup must name at least one participant")
        names = [p.name for p in self.lineup]
        if len(set(names)) != len(names):
            raise ValueError(f"Conversation.lineup names must be unique, got {names}")
        self.id = self.id or f"conv{next(_ids)}"
        if self.seed is None:
            self.seed = zlib.crc32(self.id.encode())
        own = self.run_until
        own = [] if own is None else [own] if isinstance(own, StopCondition) else list(own)
        for c in own:
            if not isinstance(c, StopCondition):
                raise ValueError(f"conversation {self.id}: run_until holds {type(c).__name__}")
        self._stop_sources = own
        self._stops: list[StopCondition] | None = None
        self._stop_requested: str | None = None
        self.views: dict[str, View] = {}

    # -- set-up -----------------------------------------------------------------------------
    def start(self) -> None:
        """Clone the stop conditions (own + ambient, each once) and render the opening views."""
        if self._stops is not None:
            return
        seen, stops = set(), []
        for c in [*self._stop_sources, *ambient_conditions()]:
            if id(c) not in seen:
                seen.add(id(c))
                stops.append(c.clone())
        self._stops = stops
        for p in self.policies():
            view = View()
            if p.system_prompt:
                view.append(p.chat.message_ids("system", p.system_prompt))
            for m in self.prompt:
                view.append(p.chat.message_ids(m.role, m.content))
            self.views[p.name] = view

    def policies(self) -> list[Policy]:
        return [p for p in self.lineup if isinstance(p, Policy)]

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
        return self.views[policy.name].token_ids + policy.chat.generation_prompt_ids()

    # -- committing a turn ------------------------------------------------------------------
    def commit(self, speaker: Participant, message: Message | None, generated: int = 0) -> None:
        """Run hooks, append the message to the transcript and every view, update stops."""
        if message is not None:
            self._check_message(speaker, message, f"participant {speaker.name!r} returned")
        for hook in self.hooks:
            if message is None:
                break
            out = hook(self, message)
            source = f"hook {getattr(hook, '__name__', hook)!r} returned"
            if out is not None and not isinstance(out, Message):
                raise ValueError(
                    f"conversation {self.id}: {source} {type(out).__name__}; "
                    "expected a Message (keep or edit) or None (drop)"
                )
            if out is not None:
                self._check_message(speaker, out, source)
            if out is not None and out is not message and out.token_ids is not None:
                out.edited = out.edited or out.content != message.content
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
        if m.speaker == p.name and m.token_ids is not None and not m.edited:
            start = len(view.token_ids)
            view.append(p.chat.generation_prompt_ids())
            s0 = len(view.token_ids)
            view.append(list(m.token_ids))
            view.own_turns.append((start, s0, len(view.token_ids), list(m.logprobs or []), m.finish_reason))
            view.append(p.chat.close_ids(m.finish_reason))
        elif m.speaker == p.name:  # edited or injected: rendered text, not sampled, never trained
            view.append(p.chat.message_ids("assistant", m.content))
        else:
            role = "user" if m.role == "assistant" else m.role
            view.append(p.chat.message_ids(role, m.content))

    def _finish(self, status: Status, reason: str) -> None:
        self.status, self.stop_reason = status, reason

    def end(self, status: Status, reason: str) -> None:
        """Mark the conversation finished by the runner (turn count reached, failure)."""
        if not self.finished:
            self._finish(status, reason)

    # -- output -----------------------------------------------------------------------------
    def trajectories(self) -> list[Trajectory]:
        """One trajectory per trainable policy participant, in lineup order."""
        out = []
        for p in self.policies():
            if not p.trainable:
                continue
            view = self.views[p.name]
            turns = view.own_turns if p.train_turns == "all" else view.own_turns[-1:]
            mask = [0] * len(view.token_ids)
            logprobs: list[float] = []
            spans = []
            for start, s0, s1, lps, reason in turns:
                mask[s0:s1] = [1] * (s1 - s0)
                logprobs.extend(lps)
                spans.append(
                    TurnSpan(start=start, end=s1, speaker=p.name, trained=True, finish_reason=reason)
                )
            complete = len(logprobs) == sum(mask)
            out.append(
                Trajectory(
                    token_ids=list(view.token_ids),
                    loss_mask=mask,
                    rollout_logprobs=logprobs if complete else None,
                    turns=spans,
                    participant=p.name,
                    group=self.group,
                    status=self.status,
                    infos={
                        "conversation": self.id,
                        "turns": self.turns_taken,
                        "stop_reason": self.stop_reason,
                        "logprobs_complete": complete,
                        **self.infos,
                    },
                )
            )
        return out
