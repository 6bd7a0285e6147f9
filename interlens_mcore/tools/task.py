"""`with_tools(source, tools)`: any task source, with tools its policy may call.

Each row's lineup keeps its participants; the environment that answers a policy seat (the
participant right after the seat, when the seat speaks again right after it) is wrapped in a
`ToolEnvironment`, so a tool call is answered with its result and the seat speaks again; the
opening transcript gains a system message presenting the tools (the chat template's own
rendering, see `render`). The turn cap grows by two turns per allowed call.

Sampling should stop at the parser's closing tag (`source.stop`, e.g. `("</tool_call>",)`) so a
policy cannot write a tool's answer itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from ..rollout.conversation import Environment, Participant, Policy
from ..tasks.base import Task, TaskSource
from ..types import Message, Trajectory
from .environment import ToolEnvironment, check_isolation, start_workers
from .parser import HermesParser, ToolCallParser
from .pool import WorkerLimits
from .render import tools_system_text
from .tool import Tool, as_tools
from .worker import run_call

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, kw_only=True)
class ToolOptions:
    """How tools are offered: the call format, the per-conversation budget, limits, isolation."""

    parser: ToolCallParser = field(default_factory=HermesParser)
    max_calls: int = 4  # tool calls per conversation; later replies go to the task's environment
    tool_timeout_s: float | None = 10.0  # one call's limit; past it the policy reads an error
    max_result_chars: int = 2000
    isolation: str = "process"  # where tools run: worker processes, or "thread" (see environment)
    worker_limits: WorkerLimits = field(default_factory=WorkerLimits)  # for isolation="process"


@dataclass(eq=False)
class ToolTask:
    """A row of the wrapped source, with the tools in its opening and its lineup."""

    inner: Task
    tools: list[Tool]
    options: ToolOptions
    tokenizer: PreTrainedTokenizerBase | None = None

    @property
    def max_turns(self) -> int:
        return self.inner.max_turns + 2 * self.options.max_calls

    def prompt(self) -> list[Message]:
        messages = list(self.inner.prompt())
        system = None
        if messages and messages[0].role == "system":
            system, messages = messages[0].content, messages[1:]
        schemas = [t.schema for t in self.tools]
        text = tools_system_text(self.tokenizer, schemas, system)
        return [Message(speaker="system", content=text, role="system"), *messages]

    def lineup(self, seat: Callable[[str], Policy]) -> list[Participant]:
        lineup = list(self.inner.lineup(seat))
        n = len(lineup)
        wrapped = list(lineup)
        for i, p in enumerate(lineup):
            if not isinstance(p, Policy):
                continue
            env, back = lineup[(i + 1) % n], lineup[(i + 2) % n]
            if not isinstance(env, Environment) or back is not p:
                raise ValueError(
                    f"with_tools: seat {p.name!r} of lineup {[q.name for q in lineup]} is not answered by "
                    "an environment before it speaks again, so a tool result would reach another seat; "
                    "tools need lineups like [policy, environment] or [environment, policy]"
                )
            o = self.options
            wrapped[(i + 1) % n] = ToolEnvironment(
                self.tools, env, policy=p.name, parser=o.parser, max_calls=o.max_calls,
                tool_timeout_s=o.tool_timeout_s, max_result_chars=o.max_result_chars,
                isolation=o.isolation, worker_limits=o.worker_limits,
            )  # fmt: skip
        return wrapped

    def __getattr__(self, name: str) -> object:
        # the wrapped row's own fields (`columns`, a reasoning-gym `entry`) stay readable by reward
        # functions, as if no tools were offered
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class ToolTaskSource(TaskSource):
    """`source`'s rows as `ToolTask`s; seats, evaluation and options carried over."""

    def __init__(
        self,
        source: TaskSource,
        tools: Sequence[Callable[..., object] | Tool],
        options: ToolOptions,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ):
        if source.scheduler() is not None:
            raise ValueError(
                f"with_tools: task source {source.name!r} runs through a scheduler; "
                "tools wrap lineup tasks only"
            )
        self.source, self.tools, self.options, self.tokenizer = source, as_tools(tools), options, tokenizer
        check_isolation(self.tools, options.isolation, "with_tools")
        if options.isolation == "process":  # the workers import the tools while the trainer starts
            start_workers(self.tools, options.worker_limits)
        self.name = f"{source.name}+tools"
        self.trained_seats, self.frozen_seats = source.trained_seats, source.frozen_seats
        self.eval_frozen_seats = source.eval_frozen_seats
        # stop strings for the policy's sampling: a turn ends right after a call
        self.stop = tuple(options.parser.stop)

    def _wrap(self, rows: Sequence[object]) -> list[ToolTask]:
        return [
            ToolTask(inner=cast(Task, r), tools=self.tools, options=self.options, tokenizer=self.tokenizer)
            for r in rows
        ]

    def rows(self, n: int, *, seed: int) -> list[ToolTask]:
        return self._wrap(self.source.rows(n, seed=seed))

    def success_of(self, trajectory: Trajectory) -> float | None:
        return self.source.success_of(trajectory)

    def dataset_of(self, row: object) -> str | None:
        assert isinstance(row, ToolTask), "this source's rows are ToolTasks"
        return self.source.dataset_of(row.inner)

    def eval_rows(self, n: int, *, seed: int) -> list[ToolTask]:
        return self._wrap(self.source.eval_rows(n, seed=seed))

    def demonstrations(self, n: int, *, seed: int) -> list[list[dict[str, str]]]:
        """The wrapped source's demonstrations with a tool call before each answer: the arithmetic
        expression of the question (its first user message) passed to the tool whose one argument
        is `expression` (`examples:calculator`, `examples:python_eval`), the tool's result as a
        `tool` message, then the source's own answer; the opening presents the tools as a rollout's
        does. A question without an expression, or whose expression the tool does not evaluate to
        an answer the reply holds, is left out."""
        tool = next((t for t in self.tools if _one_argument(t) == "expression"), None)
        parser = self.options.parser
        if tool is None or not isinstance(parser, HermesParser):
            raise NotImplementedError(
                f"{self.name}: demonstrations call a tool taking one `expression` argument (as "
                f"interlens_mcore.tools.examples:calculator does) in the <tool_call> format; the tools "
                f"here are {[t.name for t in self.tools]}"
            )
        schemas = [t.schema for t in self.tools]
        out: list[list[dict[str, str]]] = []
        for want in (n, 2 * n, 4 * n, 8 * n):
            out = []
            for demo in self.source.demonstrations(want, seed=seed):
                shown = _with_call(demo, tool, parser, self.options.max_result_chars)
                if shown is not None:
                    system = shown[0]["content"] if shown[0]["role"] == "system" else None
                    text = tools_system_text(self.tokenizer, schemas, system)
                    opening = {"role": "system", "content": text}
                    out.append([opening, *(m for m in shown if m["role"] != "system")])
                    if len(out) == n:
                        return out
        raise ValueError(
            f"{self.name}: {len(out)} of {8 * n} questions hold an arithmetic expression that "
            f"{tool.name!r} evaluates to the answer; wanted {n}"
        )

    def describe(self) -> dict[str, object]:
        o = self.options
        return {
            **self.source.describe(),
            "name": self.name,
            "tools": [t.name for t in self.tools],
            "max_calls": o.max_calls,
            "tool_timeout_s": o.tool_timeout_s,
            "isolation": o.isolation,
        }


# a number, and then at least one operator and number, with parentheses around any of them
_NUMBER = r"\(*\s*-?\d+(?:\.\d+)?\s*\)*"
_EXPRESSION = re.compile(rf"{_NUMBER}(?:\s*(?:\*\*|//|[-+*/%])\s*{_NUMBER})+")


def _one_argument(tool: Tool) -> str | None:
    """The name of the tool's only argument, or None if it takes none or several."""
    names = list(tool.schema["function"].get("parameters", {}).get("properties", {}))
    return names[0] if len(names) == 1 else None


def _with_call(
    demo: list[dict[str, str]], tool: Tool, parser: HermesParser, max_chars: int
) -> list[dict[str, str]] | None:
    """`demo` with a call of `tool` on its question's expression before its last reply (the
    answer), or None if the question holds none or the result is not in that reply."""
    question = next((m["content"] for m in demo if m["role"] == "user"), "")
    found = [m.group().strip() for m in _EXPRESSION.finditer(question)]
    if not found or demo[-1]["role"] != "assistant":
        return None
    expression = max(found, key=len)
    ok, result = run_call(tool.name, tool.fn, {"expression": expression})
    result, reply = result[:max_chars], demo[-1]["content"]
    if not ok or result.strip() not in {reply.strip(), *(t.strip() for t in re.findall(r">([^<]*)<", reply))}:
        return None
    call = json.dumps({"name": tool.name, "arguments": {"expression": expression}})
    return [
        *demo[:-1],
        {"role": "assistant", "content": f"{parser.open_tag}{call}{parser.close_tag}"},
        {"role": "tool", "content": result},
        demo[-1],
    ]


def with_tools(
    source: TaskSource,
    tools: Sequence[Callable[..., object] | Tool],
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    parser: ToolCallParser | None = None,
    max_calls: int = 4,
    tool_timeout_s: float | None = 10.0,
    isolation: str = "process",
    worker_limits: WorkerLimits | None = None,
) -> ToolTaskSource:
    """`source` with `tools` offered to its policy seats (what `--tools MODULE:FN,...` adds).

    `tokenizer`: whose chat template presents the tools (`tools=`); without one, or when its
    template ignores tools, a plain-text preamble describes them. `isolation` and
    `worker_limits`: where the tools run and under which limits (`ToolEnvironment`).
    """
    if max_calls < 1:
        raise ValueError(f"with_tools: max_calls must be >= 1, got {max_calls}")
    options = ToolOptions(
        parser=parser or HermesParser(), max_calls=max_calls, tool_timeout_s=tool_timeout_s,
        isolation=isolation, worker_limits=worker_limits or WorkerLimits(),
    )  # fmt: skip
    return ToolTaskSource(source, tools, options, tokenizer)
