"""The command line and YAML of the launch scripts, generated from the config dataclasses.

`transformers.HfArgumentParser` turns every field of `LaunchConfig`, `BackendConfig`,
`TrainerConfig`, `RolloutConfig` and `LossConfig` into `--field-name` (or `--field_name`, as TRL
and ms-swift users type it) with the field's type, default, allowed values and help line, so the
library defaults are the command-line defaults. Precedence: defaults < `--config FILE.yaml`
(keys = option names) < the command line. Every user mistake becomes a one-line `UsageError`
naming the flag; a mistyped flag or YAML key suggests the closest known one.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args, get_origin, get_type_hints

from transformers import HfArgumentParser

from interlens_mcore.agents import defaults as agent_defaults
from interlens_mcore.cli.aliases import AliasError, alias_flags, aliases_of, rename_argv, rename_keys
from interlens_mcore.grpo.loss.config import LossConfig
from interlens_mcore.plugins import working_directory_importable
from interlens_mcore.rollout.rollouter import RolloutConfig
from trainers.config import BackendConfig, TrainerConfig

REPEATABLE = ("--reward", "--reward-weights", "--reward_weights", "--task-arg", "--task_arg")
RESUME = ("no", "yes", "auto")


class UsageError(ValueError):
    """Bad input from the user: reported as one line on stderr, exit code 2."""


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What the launch script plugs in: the task, reward functions, resuming and export."""

    task: str = field(
        default="guess",
        metadata={
            "help": "guess, duel, FAMILY:ID of a task library, or MODULE:FACTORY returning a TaskSource"
        },
    )
    task_args: str = field(default="{}", metadata={"help": "JSON object of the task's options"})
    task_arg: list[str] = field(
        default_factory=list, metadata={"help": "KEY=VALUE task options, values read as YAML (repeatable)"}
    )
    reward: list[str] = field(
        default_factory=list,
        metadata={"help": "MODULE:FN reward functions added to the task's own (repeatable)"},
    )
    reward_weights: list[float] = field(
        default_factory=list, metadata={"help": "one weight per reward function, the task's first"}
    )
    no_env_reward: bool = field(
        default=False, metadata={"help": "drop the task's own reward (needs --reward)"}
    )
    dataset: str | None = field(
        default=None, metadata={"help": "JSONL / JSON / parquet / CSV file or save_to_disk folder of prompts"}
    )
    prompt_column: str = field(
        default="prompt", metadata={"help": "--dataset column of the prompt (text or chat)"}
    )
    eval_dataset: str | None = field(
        default=None, metadata={"help": "held-out prompts (default: a hashed twentieth of --dataset)"}
    )
    tools: str | None = field(
        default=None,
        metadata={
            "help": "MODULE:FN[,MODULE:FN...] Python functions the policy may call (a NAME holding a list "
            "of functions, as TRL's tools=, gives each)"
        },
    )
    environment_factory: str | None = field(
        default=None,
        metadata={
            "help": "MODULE:NAME, a TRL environment class (or callable, or dict by the rows' environment "
            "column): one per sample of --dataset, reset(**row), its public methods as tools, get_reward"
        },
    )
    multi_turn_scheduler: str | None = field(
        default=None, metadata={"help": "MODULE:CLASS or registered name of an ms-swift style scheduler"}
    )
    external_plugins: list[str] = field(
        default_factory=list, metadata={"help": ".py files to load first (they may register schedulers)"}
    )
    max_turns: int | None = field(default=None, metadata={"help": "scheduler: turn cap (0 or unset: none)"})
    loss_scale: Literal["all", "last_round"] = field(
        default="all", metadata={"help": "scheduler: which assistant rounds train"}
    )
    reward_key: str = field(default="reward", metadata={"help": "scheduler: rollout_infos key of the reward"})
    resume: str = field(
        default="no",
        metadata={"help": "continue the run in --output-dir (--resume); auto: continue it if there is one"},
    )
    export_hf: str | None = field(
        default=None, metadata={"help": "write the trained model as an HF folder here"}
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "a system message put first in every conversation's prompt"}
    )
    eval_only: bool = field(
        default=False,
        metadata={
            "help": "evaluate --model (or with --resume the run's newest checkpoint) on the task's "
            "held-out rows, print the summary and write it to --output-dir/eval.jsonl; no training"
        },
    )
    gym_env: str | None = field(
        default=None,
        metadata={"help": "scheduler: a registered gym environment (envs dict), passed as gym_env="},
    )
    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={
            "help": "reward functions by name (ms-swift's flag): built-in accuracy, format, react_format, "
            "cosine, repetition, soft_overlong, or a name in an --external-plugins file's orms dict"
        },
    )
    reward_model: str | None = field(
        default=None,
        metadata={"help": "folder of a sequence classifier whose score is the reward function reward_model"},
    )
    reward_model_label: int = field(
        default=-1, metadata={"help": "--reward-model: the logit that is the score (-1: the last)"}
    )
    reward_model_batch_size: int = field(
        default=8, metadata={"help": "--reward-model: trajectories per forward"}
    )
    judge_model: str | None = field(
        default=None,
        metadata={"help": "folder of a causal LM whose parsed verdict is the reward function judge"},
    )
    judge_template: str | None = field(
        default=None,
        metadata={"help": "--judge-model: the judge's prompt file ({prompt}, {completion}, row columns)"},
    )
    judge_max_new_tokens: int = field(default=16, metadata={"help": "--judge-model: tokens of its reply"})
    agent: str | None = field(
        default=None,
        metadata={
            "help": "MODULE:FN, an agent written against the OpenAI API (async def FN(client, row) -> "
            "reward): run once per sample against the rollout's endpoint, on rows of --dataset or --task"
        },
    )
    agent_branches: agent_defaults.Branches = field(
        default=agent_defaults.BRANCHES,
        metadata={"help": "--agent: train the last call's history, or every branch"},
    )
    agent_reply_match: agent_defaults.ReplyMatch = field(
        default=agent_defaults.REPLY_MATCH,
        metadata={
            "help": "--agent: a re-sent reply must have the text returned (text), or any assistant "
            "message where a reply stood is taken for it (position: agents that re-word replies)"
        },
    )
    agent_round_wait_s: float = field(
        default=agent_defaults.ROUND_WAIT_S,
        metadata={"help": "--agent: how long a round waits for a busy agent to call before it generates"},
    )

    def __post_init__(self) -> None:
        if self.resume not in RESUME:
            raise ValueError(f"LaunchConfig.resume must be one of {', '.join(RESUME)}, got {self.resume!r}")
        if not isinstance(self.task_arguments, dict):
            raise ValueError(f"LaunchConfig.task_args must be a JSON object, got {self.task_args!r}")

    def resuming(self, output_dir: str | None) -> bool:
        """--resume, or --resume auto with a run already in `output_dir` (a restarted worker's case)."""
        if self.resume == "auto":
            return output_dir is not None and (Path(output_dir) / "run.json").is_file()
        return self.resume == "yes"

    @property
    def task_arguments(self) -> dict[str, Any]:
        """--task-args (a JSON object) with each --task-arg KEY=VALUE over it."""
        from interlens_mcore.tasks.families import parse_task_args

        try:
            out = json.loads(self.task_args)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"LaunchConfig.task_args is not valid JSON ({exc.msg}): {self.task_args!r}"
            ) from None
        if isinstance(out, dict):
            out.update(parse_task_args(self.task_arg))
        return out


SECTIONS = (LaunchConfig, BackendConfig, TrainerConfig, RolloutConfig, LossConfig)


@dataclass(frozen=True)
class Args:
    launch: LaunchConfig
    backend: BackendConfig
    trainer: TrainerConfig
    rollout: RolloutConfig
    loss: LossConfig
    extra: tuple = ()  # the script's own sections, in the order it passed them
    # option name -> "run.json", "YAML" or "command line" for each option set (the rest: defaults)
    origins: dict[str, str] = field(default_factory=dict)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def flagify(message: str) -> str:
    """`TrainerConfig.lr must be > 0` -> `--lr must be > 0`: errors name what the user typed."""
    return re.sub(r"\b[A-Z]\w*Config\.(\w+)", lambda m: flag(m.group(1)), message)


def _fields(sections: tuple = SECTIONS) -> dict[str, dataclasses.Field]:
    return {f.name: f for cls in sections for f in dataclasses.fields(cls)}


def _closest(word: str, known: list[str]) -> str:
    match = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


class _Parser(HfArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own errors become one line, exit 2
        raise UsageError(_suggest(message, self))


def _suggest(message: str, parser: argparse.ArgumentParser) -> str:
    # "argument --on_timeout/--on-timeout: ..." -> "--on-timeout: ...": one name, the dashed one
    message = re.sub(r"argument --[\w]+/(--[\w-]+)", r"\1", message)
    known = sorted(
        {s for a in parser._actions for s in a.option_strings if s.startswith("--")} | set(alias_flags())
    )
    unknown = re.findall(r"(--[\w-]+)", message.split("arguments:", 1)[-1]) if "arguments" in message else []
    if not unknown:
        return message
    return "unrecognized arguments: " + ", ".join(u + _closest(u, known) for u in unknown)


def parser(description: str, extra: tuple = ()) -> _Parser:
    # transformers annotates the dataclass types it takes too narrowly for a tuple of them
    p = _Parser((*SECTIONS, *extra), description=description, allow_abbrev=False)  # type: ignore[arg-type]
    p.add_argument("--config", help="YAML file of options (keys as the long option names, with _ or -)")
    for action in p._actions:  # --help shows the TRL / ms-swift names of an option (cli/aliases.py)
        names = [a.replace("_", "-") for a in aliases_of(action.dest)]
        if names and action.help:
            action.help += f" (alias: {', '.join('--' + n for n in names)})"
    return p


def _merge_repeated(argv: list[str]) -> list[str]:
    """`--reward a --reward b` -> `--reward a b` (argparse would keep only the last)."""
    out: list[str] = []
    merged: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        if argv[i] in REPEATABLE:
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            merged.setdefault(argv[i].replace("_", "-"), []).extend(argv[i + 1 : j])
            i = j
        else:
            out.append(argv[i])
            i += 1
    for name, values in merged.items():
        out.extend([name, *values])
    # a bare --resume means yes (the flag users know); --resume auto / no are the other values
    return [
        x
        for k, a in enumerate(out)
        for x in (
            [a, "yes"] if a == "--resume" and (k + 1 == len(out) or out[k + 1].startswith("--")) else [a]
        )
    ]


def parse(
    argv: list[str] | None, description: str, extra: tuple = (), defaults: dict[str, Any] | None = None
) -> Args:
    """The five sections (and a script's `extra` dataclasses) from YAML and the command line.

    `defaults` (field name -> value, a script's own: the rollout script's run.json) sit between
    the library defaults and the YAML.
    """
    import sys

    working_directory_importable()  # the user's MODULE:NAME plug-ins, from where they run it
    try:  # TRL / ms-swift names to ours first: repeats and --config are found under our names
        argv = _merge_repeated(rename_argv(list(sys.argv[1:] if argv is None else argv)))
    except AliasError as exc:
        raise UsageError(str(exc)) from None
    p = parser(description, extra)
    p.set_defaults(**(defaults or {}))
    config_path = _config_path(argv)
    # the run's own values were the effective ones, a task's defaults included: kept as given
    origins: dict[str, str] = dict.fromkeys(defaults or {}, "run.json")
    if config_path is not None:
        from_yaml = read_yaml(Path(config_path), (*SECTIONS, *extra))
        p.set_defaults(**from_yaml)
        origins.update(dict.fromkeys(from_yaml, "YAML"))
    try:
        *sections, _extra = p.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    except UsageError:
        raise
    except ValueError as exc:
        text = str(exc)
        if "not used by the HfArgumentParser" in text:
            raise UsageError(_suggest("unrecognized arguments: " + text.split(":", 1)[1], p)) from None
        raise UsageError(flagify(text)) from None
    # mypy cannot count the sections of a starred slice: one per field of Args before `extra`
    origins.update(dict.fromkeys(_given(argv, p), "command line"))
    args = Args(  # type: ignore[misc]
        *sections[: len(SECTIONS)], extra=tuple(sections[len(SECTIONS) :]), origins=origins
    )
    check_finite(args)
    return args


def _given(argv: list[str], p: argparse.ArgumentParser) -> list[str]:
    """The option names (dataclass fields) `argv` sets, `--config` aside."""
    actions = p._option_string_actions
    flags = (a.split("=", 1)[0] for a in argv if a.startswith("--"))
    return [actions[f].dest for f in flags if f in actions and actions[f].dest != "config"]


def _config_path(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--config":
            if i + 1 >= len(argv):
                raise UsageError("--config needs a YAML file")
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


def _kind(tp: Any) -> tuple[type, ...]:
    """The Python types a YAML value of a field of type `tp` may have."""
    if get_origin(tp) is list:
        return (list,)
    args = [a for a in get_args(tp) if a is not type(None)] or [tp]
    kinds: list[type] = []
    for a in args:
        if get_origin(a) is not None and get_args(a) and not isinstance(get_args(a)[0], type):  # Literal
            kinds.extend({type(v) for v in get_args(a)})
        elif isinstance(a, type):
            kinds.append(a)
    if float in kinds:
        kinds.append(int)
    return tuple(kinds)


def read_yaml(path: Path, sections: tuple = SECTIONS) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise UsageError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of option names, got {type(data).__name__}")
    fields = _fields(sections)
    hints = {name: t for cls in sections for name, t in get_type_hints(cls).items()}
    try:
        names = rename_keys(data, f"--config {path}")
    except AliasError as exc:
        raise UsageError(str(exc)) from None
    out = {}
    for key, value in data.items():
        name = names[str(key)]
        if name not in fields:
            hint = _closest(name, sorted({*fields, *(f[2:].replace("-", "_") for f in alias_flags())}))
            raise UsageError(f"--config {path}: unknown key {key!r}{hint.replace('--', '')}")
        if name == "task_args" and isinstance(value, dict):
            value = json.dumps(value)
        if name in ("reward", "reward_weights") and not isinstance(value, list):
            value = [value]
        problem = _wrong_type(value, hints[name])
        if problem is not None:
            raise UsageError(f"--config {path}: {key} must be {problem}, got {value!r}")
        out[name] = value
    return out


def _wrong_type(value: Any, tp: Any) -> str | None:
    """What a YAML value of a field of type `tp` must be, if `value` is not that; else None."""
    if value is None:
        return None if type(None) in get_args(tp) else " or ".join(k.__name__ for k in _kind(tp))
    kinds = _kind(tp)
    if kinds and not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        return " or ".join(k.__name__ for k in kinds)
    if get_origin(tp) is list and get_args(tp):  # every item too (`reward: 5` is a list of one 5)
        item = get_args(tp)[0]
        if any(_wrong_type(v, item) is not None for v in value):
            return f"a list of {item.__name__}"
    return None


def check_finite(args: Args) -> None:
    """UsageError naming the flag of a float option that is inf or nan (every float option is a size)."""
    for section in (args.launch, args.backend, args.trainer, args.rollout, args.loss, *args.extra):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                what = "finite numbers" if isinstance(value, list) else "a finite number"
                raise UsageError(f"{flag(f.name)} must be {what}, got {value}")
