"""verifiers environments: their own rollouts against this rank's endpoint, their rubric as the reward.

`source(ENV)` loads a `verifiers` environment (the classic API: `SingleTurnEnv`, `ToolEnv`,
`MultiTurnEnv`, ... with a `Rubric`); ENV is one of

    NAME                  an installed environment module: `verifiers.load_environment(NAME, **args)`
    path/to/env.py        a file defining `load_environment(**args)`
    MODULE:FN, FILE:FN    the function FN of an importable module or of a .py file

and every keyword argument (`--task-arg KEY=VALUE`) but this family's own `eval_fraction` and
`success_metric` goes to that function.

Each sample runs the environment's own `rollout(input, client, model, sampling_args)` for one
dataset row, its client an `openai.AsyncOpenAI` on the sample's session of this rank's endpoint
(`interlens_mcore.agents`: the session's tokens are the trajectory, the calls of all samples are
batched in lockstep rounds). The rubric then scores the rollout; its reward is the sample's
reward, and each rubric metric is kept in the sample's infos as `verifiers/<name>`.

Success (`eval/success_rate`): the rubric metric `success_metric` names, else the first metric
whose name holds "correct" or "accuracy" (e.g. `correct_answer`, `exact_match_accuracy`), which
must lie in [0, 1]; with neither, a reward >= 1.

Rows are the environment's dataset rows, drawn from a seed alone (whole permutations first, as
`--dataset` draws them). Evaluation plays the first rows of its `eval_dataset`, or, without one,
a held-out `eval_fraction` of the dataset chosen by a fixed shuffle and never trained on (an
environment with an `eval_dataset` alone trains on the rest of it).

A rollout that ends on the policy's doing (an empty reply, a tool call that cannot be parsed
or whose tool raised, a prompt over the context) is scored as it ended, the error kept as
`verifiers_error`; any other error the environment recorded fails the sample. Rubrics with
group reward functions (scored over all samples of a row at once) are refused.

Loading an environment installs verifiers' own SIGINT / SIGTERM handlers; the handlers that
were there before (the trainer's preemption handling) are put back at once.
"""

from __future__ import annotations

import inspect
import math
import random
import signal
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import verifiers as vf  # the package root only: its classic API loads when first touched

from ..agents.task import AgentTasks
from ..plugins import load_object
from .base import TaskSource
from .families import PRETRAINED_ON_CPU
from .split import check_fraction, derive_seed

_SUCCESS_WORDS = ("correct", "accuracy")


@dataclass(eq=False)
class VerifiersRow:
    """One row of an environment's dataset (reward functions read `columns`, as a dataset row's)."""

    columns: dict[str, Any] = field(default_factory=dict)  # prompt, answer, info, example_id, ...
    split: str = "train"  # "train" or "eval": which dataset it came from


def installed_id(spec: str) -> bool:
    """Whether `spec` names an installed environment (not a file, not MODULE:FN)."""
    return ":" not in spec and not spec.endswith(".py") and "/" not in spec


def load_function(spec: str) -> Callable[..., Any]:
    """The function building the environment that `spec` names (see the module docstring)."""
    what = "verifiers:"
    if not spec.strip():
        raise ValueError("verifiers: expected an environment id, a .py file or MODULE:FN after 'verifiers:'")
    if ":" in spec:
        fn = load_object(spec, what=what)
    elif not installed_id(spec):
        fn = load_object(f"{spec}:load_environment", what=what)
    else:
        import importlib.util

        from verifiers.utils.env_utils import env_module_name, import_env_module

        module = env_module_name(spec)
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"verifiers: no installed environment module {module!r} (from {spec!r}); expected an "
                "installed verifiers environment's id, a path to a .py file defining "
                "load_environment(**kwargs), or MODULE:FN"
            )
        fn = getattr(import_env_module(spec), "load_environment", None)
        if fn is None:
            raise ValueError(f"verifiers: the module {module!r} defines no load_environment")
    if not callable(fn):
        raise ValueError(
            f"verifiers: {spec!r} is a {type(fn).__name__}, not callable; "
            "expected FN(**kwargs) returning an Environment"
        )
    return fn


def environment_args(spec: str) -> set[str] | None:
    """The keyword arguments the environment's function takes (None: it takes **kwargs, or the
    function cannot be found: that error comes when the source is built)."""
    try:
        fn = load_function(spec)
        params = inspect.signature(fn).parameters.values()
    except Exception:  # building the source names the problem (resolve_task), with its spec
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


@contextmanager
def kept_signal_handlers() -> Iterator[None]:
    """Put back the SIGINT / SIGTERM handlers a verifiers environment replaces when it is built
    (its own end the process; the trainer's save a checkpoint first)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


def load(spec: str, **env_args: object) -> Any:
    """The environment `spec` names, built with `env_args` (the trainer's signal handlers kept)."""
    fn = load_function(spec)
    with kept_signal_handlers():
        # verifiers' own loader for an installed environment: it records the id and arguments
        env = vf.load_environment(spec, **env_args) if installed_id(spec) else fn(**env_args)
    if not isinstance(env, vf.Environment):
        raise ValueError(
            f"verifiers:{spec}: the function returned {type(env).__name__}, expected a verifiers "
            "Environment (SingleTurnEnv, ToolEnv, MultiTurnEnv, ...)"
        )
    if env.rubric.has_group_rewards:
        raise ValueError(
            f"verifiers:{spec}: its rubric has group reward functions, which score all samples of a "
            "row together; this family scores each rollout alone (use individual reward functions)"
        )
    return env


class VerifiersRows(TaskSource):
    """The rows of an environment's datasets (module docstring)."""

    def __init__(self, env: Any, *, name: str, eval_fraction: float = 0.1):
        check_fraction(eval_fraction, f"{name}: eval_fraction")
        self.name, self.eval_fraction = name, eval_fraction
        train = env.build_dataset()
        held = env.build_eval_dataset()
        if train is None:  # an environment with an eval_dataset alone: train on part of it
            train, held = held, None
        self._data = train
        self._eval_data = held
        order = list(range(len(train)))
        if held is None:
            random.Random(0).shuffle(order)  # a fixed split: the same held-out rows on every run
            k = math.ceil(eval_fraction * len(train)) if len(train) > 1 else 0
            self._eval = sorted(order[:k])
            self._train = sorted(order[k:])
        else:
            self._train, self._eval = order, list(range(len(held)))
        if not self._train:
            raise ValueError(f"{name}: the environment's dataset has no rows to train on")

    def _row(self, index: int, split: str) -> VerifiersRow:
        data = self._data if split == "train" or self._eval_data is None else self._eval_data
        return VerifiersRow(columns=dict(data[index]), split=split)

    def rows(self, n: int, *, seed: int) -> list[VerifiersRow]:
        rng = random.Random(derive_seed(seed, "verifiers"))
        picked: list[int] = []
        while len(picked) < n:  # whole permutations first, so no row repeats before all were drawn
            picked.extend(rng.sample(self._train, min(n - len(picked), len(self._train))))
        return [self._row(i, "train") for i in picked]

    def eval_rows(self, n: int, *, seed: int) -> list[VerifiersRow]:
        """The first `n` evaluation rows, the same at every evaluation (`seed` is not used)."""
        return [self._row(i, "eval") for i in self._eval[:n]]

    def option_defaults(self) -> dict[str, object]:
        return {**PRETRAINED_ON_CPU, "max_new_tokens": 64}

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "train_rows": len(self._train),
            "eval_rows": len(self._eval),
            "eval_from": "eval_dataset" if self._eval_data is not None else "held-out dataset rows",
            "eval_fraction": self.eval_fraction if self._eval_data is None else None,
        }


def success_metric_of(metrics: Sequence[str], chosen: str | None, *, where: str) -> str | None:
    """The rubric metric read as success (module docstring), or None: the reward decides."""
    if chosen is None:
        return next((m for m in metrics if any(w in m.lower() for w in _SUCCESS_WORDS)), None)
    if chosen not in metrics:
        raise ValueError(
            f"{where}: success_metric {chosen!r} is not a metric of the rubric; it has {list(metrics)}"
        )
    return chosen


class EnvironmentRollout:
    """The agent of a verifiers sample: the environment's rollout of the row, scored by its rubric.

    `success_metric`: the rubric metric that says whether the sample succeeded (None: a reward
    >= 1 does)."""

    def __init__(self, env: Any, *, name: str, success_metric: str | None = None, model: str = "policy"):
        self.env, self.name, self.success_metric, self.model = env, name, success_metric, model

    async def __call__(self, client: Any, row: VerifiersRow) -> dict[str, object]:
        from verifiers.clients import OpenAIChatCompletionsClient

        env = self.env
        state = await env.rollout(
            dict(row.columns), OpenAIChatCompletionsClient(client), self.model, env.sampling_args
        )
        await env.rubric.score_rollout(state)
        await env.rubric.cleanup(state)
        error = state.get("error")
        out: dict[str, object] = {}
        if error is not None:
            if not isinstance(error, (vf.InvalidModelResponseError, vf.ToolError)):
                raise RuntimeError(
                    f"{self.name}: the rollout failed: {type(error).__name__}: {error}"
                ) from error
            out["verifiers_error"] = f"{type(error).__name__}: {error}"
        metrics: Mapping[str, float] = state.get("metrics") or {}
        reward = float(state["reward"])
        metric = self.success_metric
        success = float(reward >= 1.0) if metric is None else float(metrics[metric])
        out.update({f"verifiers/{k}": float(v) for k, v in metrics.items()})
        if state.get("stop_condition") is not None:
            out["verifiers_stop"] = str(state["stop_condition"])
        return {"reward": reward, "success": success, **out}

    def __repr__(self) -> str:
        return f"EnvironmentRollout({self.name})"


def source(
    name: str, *, eval_fraction: float = 0.1, success_metric: str | None = None, **env_args: object
) -> TaskSource:
    """The task source of `--task verifiers:ENV`: `env_args` build the environment; `eval_fraction`
    and `success_metric` are this family's own (module docstring)."""
    label = f"verifiers:{name}"
    env = load(name, **env_args)
    rows = VerifiersRows(env, name=label, eval_fraction=eval_fraction)
    # the rubric's function names are the keys of the metrics it writes into a rollout's state
    metric = success_metric_of(env.rubric._get_reward_func_names(), success_metric, where=label)
    agent = EnvironmentRollout(env, name=label, success_metric=metric)
    return AgentTasks(agent, rows, name=label)
