"""Options of the launch scripts: defaults, YAML (`--config`), CLI overrides, parsed once here.

Precedence: built-in defaults < the YAML file < options given on the command line. Every
user mistake becomes a `UsageError` whose message is one line; the scripts print it to
stderr and exit with code 2 before anything is written.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULTS: dict[str, Any] = {
    "env": "guess",
    "opponent": "self",
    "eval_every": 10,
    "backend": "megatron",
    "tp": 1,
    "zero_stage": 3,
    "model": None,  # None: the tiny local Qwen2 model, built on first use
    "output_dir": "runs/grpo",
    "resume": False,
    "export_hf": None,
    "steps": 150,
    "seed": 0,
    "batch_size": 32,  # conversations per rank per step
    "num_generations": 8,
    "max_new_tokens": 6,
    "temperature": 1.0,
    "micro_batch_size": 0,
    "updates_per_rollout": 1,
    "lr": 2e-3,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "save_every": 10,
    "epsilon": 0.2,
    "epsilon_high": None,
    "dual_clip": None,
    "beta": 0.005,
    "kl_estimator": "k3",
    "aggregation": "token-mean",
    "is_mode": "token_truncate",
    "is_threshold": 2.0,
    "bypass": False,
    "scale_by_std": True,
    "drop_zero_variance": False,
    "max_guesses": 3,
    "step_timeout_s": None,  # None: environment steps have no time limit
    "on_timeout": "zero",
}
# options that may differ between a run and its resumption
RESUMABLE = {"resume", "export_hf", "save_every", "output_dir"}
HELP = {
    "env": "guess (guess-a-number, one policy) or duel (two-seat number duel, self-play)",
    "opponent": "duel: who plays player_b: self (the trained policy), random, or frozen (initial weights)",
    "eval_every": "steps between evaluations against a fixed random opponent (duel; 0: never)",
    "step_timeout_s": "time limit of one environment step in seconds; a sample past it ends TIMEOUT",
    "on_timeout": "a timed-out sample scores 0 (zero) or leaves the batch (drop)",
    "backend": "megatron (megatron-core GPTModel) or deepspeed (HF model under ZeRO)",
    "tp": "tensor-parallel size (megatron backend)",
    "zero_stage": "DeepSpeed ZeRO stage 1, 2 or 3",
    "config": "YAML file of options (keys as the long option names, with _ or -)",
    "model": "HF checkpoint folder (default: the tiny local model)",
    "export_hf": "write the trained model as an HF folder here (megatron backend)",
    "batch_size": "conversations per rank per step; a multiple of --num-generations",
    "is_mode": "rollout IS correction: none, token_truncate, token_mask, sequence_*, turn_*",
}


class UsageError(ValueError):
    """Bad input from the user: reported as one line on stderr, exit code 2."""


@dataclass(frozen=True)
class Options:
    values: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


def _parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", help=HELP["config"])
    for key, default in DEFAULTS.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=HELP.get(key))
        else:
            kind = type(default) if default is not None else str
            kind = float if key in ("epsilon_high", "dual_clip", "step_timeout_s") else kind
            p.add_argument(flag, type=kind, default=None, help=HELP.get(key))
    return p


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors also become one line, exit 2
        raise UsageError(message)


def parse(argv: list[str] | None, description: str) -> Options:
    parser = _parser(description)
    parser.__class__ = _Parser
    args = vars(parser.parse_args(argv))
    values = dict(DEFAULTS)
    if args.pop("config"):
        values.update(read_yaml(Path(parser.parse_args(argv).config)))
    values.update({k: v for k, v in args.items() if v is not None})
    if isinstance(values["is_mode"], str) and values["is_mode"].lower() == "none":
        values["is_mode"] = None
    return Options(values)


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise UsageError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of option names, got {type(data).__name__}")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in DEFAULTS:
            raise UsageError(f"--config {path}: unknown key {key!r} (known: {', '.join(sorted(DEFAULTS))})")
        expected = type(DEFAULTS[name])
        if DEFAULTS[name] is not None and value is not None and not isinstance(value, expected):
            if not (expected is float and isinstance(value, int)):
                raise UsageError(f"--config {path}: {key} must be {expected.__name__}, got {value!r}")
        out[name] = value
    return out


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate(opts: Options) -> None:
    """Every check that needs no process group, so bad input fails before anything starts."""
    from interlens_mcore.envs import ENVS, OPPONENTS

    if opts.env not in ENVS:
        raise UsageError(f"--env must be one of {', '.join(ENVS)}, got {opts.env!r}")
    if opts.opponent not in OPPONENTS:
        raise UsageError(f"--opponent must be one of {', '.join(OPPONENTS)}, got {opts.opponent!r}")
    if opts.opponent != "self" and opts.env != "duel":
        raise UsageError(f"--opponent {opts.opponent} needs --env duel (--env {opts.env} has one seat)")
    if opts.eval_every < 0:
        raise UsageError(f"--eval-every must be >= 0, got {opts.eval_every}")
    if opts.backend not in ("megatron", "deepspeed"):
        raise UsageError(f"--backend must be megatron or deepspeed, got {opts.backend!r}")
    if opts.zero_stage not in (1, 2, 3):
        raise UsageError(f"--zero-stage must be 1, 2 or 3, got {opts.zero_stage}")
    if opts.tp < 1 or world_size() % opts.tp:
        raise UsageError(f"--tp {opts.tp} does not divide the world size {world_size()}")
    if opts.backend == "deepspeed" and opts.tp != 1:
        raise UsageError(f"--tp {opts.tp}: the deepspeed backend has no tensor parallelism (use --tp 1)")
    if opts.num_generations < 1 or opts.batch_size < 1 or opts.batch_size % opts.num_generations:
        raise UsageError(
            f"--num-generations {opts.num_generations} does not fit --batch-size {opts.batch_size}: "
            "the batch must hold whole groups (a positive multiple of num_generations)"
        )
    if opts.model is not None and not (Path(opts.model) / "config.json").is_file():
        raise UsageError(f"--model {opts.model}: not an HF checkpoint folder (no config.json)")
    folder = model_folder(opts)
    check_heads(json.loads((folder / "config.json").read_text()), opts.tp, str(folder))
    if opts.export_hf is not None and opts.backend != "megatron":
        raise UsageError("--export-hf is available with --backend megatron only")


def model_folder(opts: Options) -> Path:
    """--model, or the tiny local model (built once, atomically, so ranks may race)."""
    from interlens_mcore.assets import ensure_tiny_model

    return Path(opts.model) if opts.model is not None else ensure_tiny_model()


def check_heads(hf_config: dict, tp: int, where: str) -> None:
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = hf_config.get(key) or hf_config.get("num_attention_heads")
        if n % tp:
            raise UsageError(f"--tp {tp} does not divide {key}={n} of the model in {where}")


def check_output_dir(opts: Options, run: dict) -> None:
    """An output folder may hold nothing, or this same run when resuming."""
    out = Path(opts.output_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output-dir {out}: exists and is not a folder")
    info = out / "run.json"
    if not info.is_file():
        if out.is_dir() and any(p.name != ".lock" for p in out.iterdir()):
            raise UsageError(f"--output-dir {out}: holds files that are not a run of this script")
        return
    if not opts.resume:
        raise UsageError(f"--output-dir {out}: holds another run; pass --resume or choose an empty folder")
    old = json.loads(info.read_text())
    changed = sorted(k for k in set(old) | set(run) if old.get(k) != run.get(k))
    if changed:
        raise UsageError(f"--output-dir {out}: --resume with different options: {', '.join(changed)}")


def hold_lock(out: Path):
    """Take OUTPUT_DIR/.lock for this process's lifetime (rank 0 only).

    A run whose launcher was killed may leave workers running (torchrun starts them in their
    own sessions); a second run writing into the same folder would interleave with them.
    The kernel drops the lock when the holder dies, so a killed run never blocks its resume.
    """
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    handle = (out / ".lock").open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UsageError(
            f"--output-dir {out}: another process is still writing to it (.lock is held)"
        ) from None
    return handle


def run_identity(opts: Options) -> dict:
    """The options that define a run (resuming must not change them)."""
    return {k: v for k, v in opts.values.items() if k not in RESUMABLE}
