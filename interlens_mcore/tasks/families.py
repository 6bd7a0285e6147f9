"""`--task FAMILY:NAME` to a task source: one factory per family of outside task libraries.

    make_source("reasoning_gym:basic_arithmetic", max_attempts=2)
    make_source("gym:FrozenLake-v1", is_slippery=False)
    make_source("textarena:TicTacToe-v0", opponent="random")
    make_source("verifiers:my_env.py", num_examples=50)

`parse_task_args` reads `--task-arg KEY=VALUE` pairs into typed keyword arguments. Each
family's module is imported only when named, so a missing optional package (`pip install
interlens_mcore[tasks]`, or `[agents]` for verifiers) fails with its name, and only for the
family that needs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

from .base import TaskSource

FAMILIES = {
    "reasoning_gym": ("interlens_mcore.tasks.reasoning_gym", "reasoning-gym"),
    "gym": ("interlens_mcore.tasks.gym", "gymnasium"),
    "textarena": ("interlens_mcore.tasks.textarena", "textarena"),
    "verifiers": ("interlens_mcore.tasks.verifiers_env", "verifiers"),
}
# the extra of setup.py that installs a family's package (the others: "tasks")
EXTRAS = {"verifiers": "agents"}


# What the task families run with unless the user says otherwise: the tiny default model answers
# only digits (it is warm-started on guess-a-number), so a task library's words, tags and moves
# need a pretrained one; SmolLM2-135M-Instruct, sized for a CPU (the settings of
# launch/configs/smollm2_basic_arithmetic.yaml, which learns). Each family adds its reply length.
PRETRAINED_ON_CPU: dict[str, object] = {
    "model": "smollm2",
    "batch_size": 16,
    "num_generations": 8,
    "temperature": 0.7,
    "lr": 1e-5,
    "beta": 0.0,
    # the update's forward holds logits [tokens, 49152] and about 1.4 MB of activations a token
    # (30 layers): 4 short trajectories a micro-batch fit a CPU machine's memory; the accumulated
    # micro-batches give the same update as one
    "micro_batch_size": 4,
}

# a game or an episode is one long conversation a trajectory (a textarena self-play game is two of
# them, up to thousands of tokens each): one a micro-batch. 4 of them took a rank of SmolLM2 past
# 7 GB and a 2-rank ConnectFour run on a 23 GB machine was killed for memory at its third step.
# Held-out episodes cost as much as training ones: with the default 128 a rank, a 2-rank Taxi run
# began with 256 episodes of up to 24 replies, 16 times a training step's 16, and had not finished
# them after 7 minutes; 16 a rank is two steps' worth. Their activations are what fills memory:
# one step of two 3,000-token trajectories of SmolLM2 peaked at 16.4 GB on one rank, 8.1 GB with
# activation checkpointing (benchmarks/bench_memory.py --tokens 3000); a 2-rank CliffWalking run
# without it was killed for memory in its first update (a rank at 12.2 GB)
LONG_CONVERSATIONS: dict[str, object] = {
    **PRETRAINED_ON_CPU,
    "micro_batch_size": 1,
    "eval_size": 16,
    "recompute": True,
}


def make_source(spec: str, **task_args: object) -> TaskSource:
    """The task source `spec` ("FAMILY:NAME") names, built by its family's `source(NAME, **task_args)`."""
    family, sep, name = spec.partition(":")
    if not sep or family not in FAMILIES or not name:
        raise ValueError(f"task {spec!r}: expected FAMILY:NAME with FAMILY one of {sorted(FAMILIES)}")
    module, package = FAMILIES[family]
    try:
        factory = importlib.import_module(module).source
        return factory(name, **task_args)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"task {spec!r} needs the package {package!r} ({exc}); "
            f"install interlens_mcore[{EXTRAS.get(family, 'tasks')}]"
        ) from exc


def family_factory(family: str) -> Callable[..., TaskSource] | None:
    """The `source(NAME, **task_args)` factory of `family`, or None when its package is missing
    (`make_source` then says which package to install)."""
    try:
        return importlib.import_module(FAMILIES[family][0]).source
    except ModuleNotFoundError:
        return None


def extra_task_args(family: str, name: str) -> set[str] | None:
    """The keyword arguments a family's factory passes on through `**` (gym: to `gymnasium.make`
    and the environment's constructor; verifiers: to the environment's function); None where
    they cannot be listed."""
    if family == "verifiers":  # by name, as every family's module: none is imported unless named
        return importlib.import_module(FAMILIES[family][0]).environment_args(name)
    if family != "gym":
        return None
    import inspect

    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    try:
        spec = gymnasium.spec(name)
        entry = spec.entry_point
        creator = load_env_creator(entry) if isinstance(entry, str) else entry
        params = inspect.signature(creator).parameters.values()  # type: ignore[arg-type]
    except Exception:  # an unknown id: gymnasium's own error comes when the source is built
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    make = inspect.signature(gymnasium.make).parameters
    return {p.name for p in params} | {n for n in make if n not in ("id", "kwargs")}


def parse_task_args(pairs: Sequence[str]) -> dict[str, object]:
    """`["max_attempts=3", "is_slippery=false"]` (the `--task-arg KEY=VALUE` form) as typed values.

    Each value is read as YAML (`3` an int, `0.5` a float, `false` a bool, `null` None, `[1, 2]`
    a list); anything else stays a string (`1,3` for reasoning-gym weights).
    """
    import yaml

    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"task argument {pair!r}: expected KEY=VALUE with KEY a name")
        if key in out:
            raise ValueError(f"task argument {key!r} given twice")
        try:
            out[key] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            out[key] = value
    return out
