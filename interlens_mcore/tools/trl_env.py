"""TRL's `environment_factory` classes, trained here as written (`--environment-factory MODULE:NAME`).

A TRL environment is a class (or any callable making one) with `reset(**row)`, public methods
the policy calls as tools, and optionally `get_reward()`. Over the rows of a prompt dataset
(`--dataset`) this source runs them the way TRL 1.16's `GRPOTrainer(environment_factory=...)`
does:

- one instance per sample, made when its conversation is built; `reset(**row)` gets every
  column of the dataset row (with a dict of factories, every column but `environment`, which
  picks the factory), and the string it returns is appended to the prompt's last message;
- every public method of the instance's class but `reset` and `get_reward` is a tool, its
  schema from its signature and Google docstring (transformers' `get_json_schema`, as TRL);
  the schemas are presented by the chat template (`tools=`, `tools.render`), standalone tool
  functions (`--tools`) beside them;
- the policy calls them in the Hermes form (`<tool_call>{...}</tool_call>`); each result, or
  the error text of a method that raised, is the next message (a `tool` message, loss mask 0),
  and a reply without a call ends the conversation; methods run in this process, each call
  bounded by `tool_timeout_s` (`ToolEnvironment`, `isolation="thread"`: a method that never
  returns costs its call, and the step time limit bounds the turn);
- `get_reward()` (sync or async) is a reward source named after the class (`reward/<Class>`),
  None for samples of another class; TRL-convention reward functions also get
  `environments=`, the instance of each sample.

Unlike TRL, instances are not pooled across steps: each sample's is made fresh (`reset` is
still called once on it, so a class written for TRL's pool behaves the same).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..grpo.rewards import RewardFn
from ..rewards.conventions import awaited
from ..rollout.conversation import Conversation, Participant, Policy
from ..tasks.base import TaskSource
from ..tasks.dataset import DatasetSource, PromptRow
from ..types import Message, Trajectory
from .environment import ToolEnvironment
from .parser import HermesParser
from .render import tools_system_text
from .tool import Tool, as_tool, as_tools

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Factory = Callable[[], Any]
NOT_TOOLS = ("reset", "get_reward")
OPTIONS = ("max_calls", "tool_timeout_s", "max_result_chars")  # what --task-arg sets here


def factories_of(obj: object, *, what: str) -> dict[str | None, Factory]:
    """`{name: factory}`: a dict as given (rows pick one by their `environment` column), a single
    class or callable as `{None: it}`."""
    given = obj if isinstance(obj, Mapping) else {None: obj}
    if not given:
        raise ValueError(f"{what}: an empty dict of environments")
    for name, factory in given.items():
        if not callable(factory):
            label = "" if name is None else f"[{name!r}]"
            raise ValueError(f"{what}{label}: {type(factory).__name__} is not a class or callable")
    return dict(given)


def tool_methods(instance: object) -> list[Callable[..., object]]:
    """The instance's tools: the public methods of its class but `reset` and `get_reward`
    (listed on the class, so properties are not evaluated)."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


def check_instance(instance: object, where: str) -> None:
    if not callable(getattr(type(instance), "reset", None)):
        raise ValueError(f"{where}: {type(instance).__name__} has no reset(**row) method")


class EnvironmentTools(ToolEnvironment):
    """The tools of one sample's instance; a reply without a call ends the conversation.

    It records the instance under the conversation's id in `registry`, where the reward
    functions find it.
    """

    def __init__(self, instance: object, tools: Sequence[Tool], registry: dict[str, object], **options: Any):
        super().__init__(tools, None, isolation="thread", **options)
        self.instance, self.registry = instance, registry
        self.name = type(instance).__name__

    async def respond(self, conv: Conversation) -> object:
        self.registry[conv.id] = self.instance
        return await super().respond(conv)

    def reward_for(self, conv: Conversation, participant: str) -> float | None:
        self.registry[conv.id] = self.instance  # also when the policy never spoke (a turn cap of 1)
        return None  # the environment's reward is `get_reward`, a reward source of its own


@dataclass(eq=False)
class EnvironmentRow:
    """A dataset row whose samples each get an environment instance.

    A conversation is built from `lineup(seat)` and `prompt()`, once each per sample; the k-th
    call of either belongs to the k-th sample, whichever comes first, so both see one instance.
    """

    row: PromptRow
    source: EnvironmentSource
    made: list[tuple[object, list[Tool], str | None]] = field(default_factory=list)
    lineups: int = 0
    prompts: int = 0

    @property
    def columns(self) -> dict[str, object]:  # what reward functions read (`rewards.inputs`)
        return self.row.columns

    @property
    def max_turns(self) -> int:
        return self.row.max_turns + 2 * self.source.max_calls

    def _sample(self, k: int) -> tuple[object, list[Tool], str | None]:
        while len(self.made) <= k:
            self.made.append(self.source.instance_for(self.row))
        return self.made[k]

    def prompt(self) -> list[Message]:
        _, tools, observation = self._sample(self.prompts)
        self.prompts += 1
        messages = list(self.row.messages)
        system = None
        if messages and messages[0].role == "system":
            system, messages = messages[0].content, messages[1:]
        if observation is not None and messages:  # TRL appends it to the last message, as it is
            last = messages[-1]
            messages[-1] = Message(speaker=last.speaker, content=last.content + observation, role=last.role)
        text = tools_system_text(self.source.tokenizer, [t.schema for t in tools], system)
        return [Message(speaker="system", content=text, role="system"), *messages]

    def lineup(self, seat: Callable[[str], Policy]) -> list[Participant]:
        instance, tools, _ = self._sample(self.lineups)
        self.lineups += 1
        s = self.source
        env = EnvironmentTools(
            instance, tools, s.registry, max_calls=s.max_calls, tool_timeout_s=s.tool_timeout_s,
            max_result_chars=s.max_result_chars,
        )  # fmt: skip
        return [seat("policy"), env]


class EnvironmentSource(TaskSource):
    """The rows of `dataset`, each sample with an instance of its environment (module docstring)."""

    def __init__(
        self,
        dataset: DatasetSource,
        factories: Mapping[str | None, Factory],
        *,
        tools: Sequence[Callable[..., object] | Tool] = (),
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_calls: int = 4,
        tool_timeout_s: float | None = 10.0,
        max_result_chars: int = 2000,
        what: str = "environment_factory",  # how errors name the factory (the flag and its value)
    ):
        if max_calls < 1:
            raise ValueError(f"environment_factory: max_calls must be >= 1, got {max_calls}")
        self.dataset, self.factories = dataset, dict(factories)
        self.tools = [as_tool(t) for t in tools]
        self.tokenizer, self.max_calls = tokenizer, max_calls
        self.tool_timeout_s, self.max_result_chars = tool_timeout_s, max_result_chars
        self.multi, self.what = None not in self.factories, what
        self.registry: dict[str, object] = {}  # conversation id -> its instance, for the rewards
        self.name = f"{dataset.name}+env"
        self.stop = HermesParser().stop
        for row in dataset._train + dataset._eval:
            self.factory_of(row)  # every row names a known environment before anything starts
        # one instance of each environment, as TRL probes them: its reset and its tools' schemas
        self.classes = []
        for name, factory in self.factories.items():
            probe = factory()
            check_instance(probe, self._label(name))
            as_tools(self.tools + [as_tool(m) for m in tool_methods(probe)])
            self.classes.append(type(probe))

    def _label(self, name: str | None) -> str:
        return self.what + ("" if name is None else f"[{name!r}]")

    def factory_of(self, row: PromptRow) -> tuple[str | None, Factory]:
        if not self.multi:
            return None, self.factories[None]
        name = row.columns.get("environment")
        if name not in self.factories:
            raise ValueError(
                f"dataset {self.dataset.path!r}: a row has environment={name!r}; a dict environment_factory "
                f"picks by that column, expected one of {sorted(map(str, self.factories))}"
            )
        return str(name), self.factories[name]

    def instance_for(self, row: PromptRow) -> tuple[object, list[Tool], str | None]:
        """A new instance for one sample of `row`, reset on the row: (instance, its tools, the text
        reset returned)."""
        name, factory = self.factory_of(row)
        instance = factory()
        check_instance(instance, self._label(name))
        kwargs = {k: v for k, v in row.columns.items() if not (self.multi and k == "environment")}
        observation = instance.reset(**kwargs)
        if observation is not None and not isinstance(observation, str):
            raise ValueError(
                f"{type(instance).__name__}.reset returned {type(observation).__name__}; expected a string "
                "(appended to the prompt's last message) or None"
            )
        tools = as_tools(self.tools + [as_tool(m) for m in tool_methods(instance)])
        return instance, tools, observation

    def rows(self, n: int, *, seed: int) -> list[EnvironmentRow]:
        self.registry.clear()  # the previous step's rewards are computed
        return [EnvironmentRow(r, self) for r in self.dataset.rows(n, seed=seed)]

    def eval_rows(self, n: int, *, seed: int) -> list[EnvironmentRow]:
        self.registry.clear()
        return [EnvironmentRow(r, self) for r in self.dataset.eval_rows(n, seed=seed)]

    def success_of(self, trajectory: Trajectory) -> float | None:
        return self.dataset.success_of(trajectory)

    def option_defaults(self) -> dict[str, object]:
        return {"max_new_tokens": 128}  # room for a call in one reply

    def environments(self, trajectories: Sequence[Trajectory]) -> list[object | None]:
        """Each trajectory's instance (what TRL passes reward functions as `environments`)."""
        return [self.registry.get(t.infos.conversation or "") for t in trajectories]

    def reward_functions(self) -> list[RewardFn]:
        """`get_reward` of each environment class that has one, named after the class."""
        owning = [cls for cls in dict.fromkeys(self.classes) if callable(getattr(cls, "get_reward", None))]
        return [EnvironmentReward(cls, self) for cls in owning]

    def describe(self) -> dict[str, object]:
        return {
            **self.dataset.describe(),
            "name": self.name,
            "environments": {str(k): reference(f) for k, f in self.factories.items()},
            "tools": [t.name for t in self.tools],
            "max_calls": self.max_calls,
            "tool_timeout_s": self.tool_timeout_s,
        }


def reference(factory: Factory) -> str:
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', type(factory).__name__)}"


class EnvironmentReward:
    """`get_reward()` of the samples whose instance is exactly `cls` (None for the others, as TRL)."""

    def __init__(self, cls: type, source: EnvironmentSource):
        self.cls, self.source, self.name = cls, source, cls.__name__

    def __call__(self, trajectories: Sequence[Trajectory], rows: Sequence[object]) -> list[float | None]:
        out: list[float | None] = []
        for env in self.source.environments(trajectories):
            if type(env) is not self.cls:
                out.append(None)
                continue
            value = awaited(env.get_reward())  # type: ignore[attr-defined]  # the class has it
            out.append(None if value is None else float(value))  # type: ignore[arg-type]
        return out


def with_environments(fns: Sequence[RewardFn], source: EnvironmentSource) -> list[RewardFn]:
    """`fns` with each TRL-convention function also given `environments=`, then the sources'
    `get_reward` functions (what TRL adds after the user's reward functions)."""
    from ..rewards.conventions import TRLReward

    def per_sample(trajectories: Sequence[Trajectory]) -> dict[str, list[object]]:
        return {"environments": list(source.environments(trajectories))}

    out: list[RewardFn] = [
        TRLReward(f.fn, f.name, per_sample) if isinstance(f, TRLReward) else f for f in fns
    ]
    return out + source.reward_functions()


def source(
    dataset: DatasetSource,
    spec_or_factory: object,
    *,
    tools: Sequence[Callable[..., object] | Tool] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    **options: Any,
) -> EnvironmentSource:
    """`EnvironmentSource` of `dataset` with a factory, a dict of them, or `MODULE:NAME` naming one."""
    from ..plugins import load_object

    what = "--environment-factory"
    obj = load_object(spec_or_factory, what=what) if isinstance(spec_or_factory, str) else spec_or_factory
    if isinstance(spec_or_factory, str):
        what = f"--environment-factory {spec_or_factory}"
    factories = factories_of(obj, what=what)
    return EnvironmentSource(dataset, factories, tools=tools, tokenizer=tokenizer, what=what, **options)
