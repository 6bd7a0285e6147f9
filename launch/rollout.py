"""Run rollouts without training and write every trajectory as JSONL, to see what a model and
a task produce.

    torchrun --nproc_per_node=2 launch/rollout.py --output-dir runs/look --steps 1
    torchrun --nproc_per_node=2 launch/rollout.py --checkpoint runs/grpo --output-dir runs/look-trained
    python launch/rollout.py --backend deepspeed --zero-stage 1 --output-dir runs/look

Writes OUTPUT_DIR/rollouts.jsonl as it goes (each round appended and flushed: a kill loses at
most the round in flight): one object per trajectory with its round, seat, reward and
advantage, the transcript, the token ids and loss mask, and per trained turn its text, ids and
logprobs. `--steps` is the number of rollout rounds (default 1; a round is what one training
step plays: --batch-size samples per rank). `--checkpoint` loads the weights of a training run
(its newest intact checkpoint) or of one `step-NNNNNN` folder, and the run's options from its
run.json (task, model, backend, sampling); `--config` and the command line override them, and
an option the checkpoint cannot load under (another --backend or --model) is refused.
Training-only options (optimizer, loss, checkpoints, logging) are refused on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from interlens_mcore import distributed
from interlens_mcore.cli import (
    defaults,
    quiet,  # noqa: F401  (before megatron / DeepSpeed are imported)
)
from interlens_mcore.cli.args import SECTIONS, Args, LaunchConfig, UsageError, flag, parse, parser
from interlens_mcore.cli.build import build_trainer, check, world_size
from interlens_mcore.cli.lines import say
from interlens_mcore.rollout.rollouter import RolloutConfig, whole_batch_advantages
from trainers import checkpoint, rundir
from trainers.config import BackendConfig
from trainers.report.reporter import fmt, progress_bar

OUT_FILE = "rollouts.jsonl"
DEFAULT_ROUNDS = 1


@dataclass(frozen=True, kw_only=True)
class RolloutScriptConfig:
    checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "a training run folder (its newest intact checkpoint) or a step-NNNNNN folder; "
            "the run's options come from its run.json"
        },
    )


def _names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# the options a rollout uses: the task, the model and how it is split, sampling, the round size
USED = (
    (_names(LaunchConfig) - {"resume", "export_hf"})
    | (_names(BackendConfig) - {"vllm_sleep"})
    | (_names(RolloutConfig) - {"micro_batch_size"})
    | {"steps", "batch_size", "output_dir", "collective_timeout_s"}
)
TRAINING_ONLY = {name for cls in SECTIONS for name in _names(cls)} - USED
# what defines the task: a task named on the command line takes none of these from the run
TASK_KEYS = {
    "task",
    "task_args",
    "task_arg",
    "dataset",
    "prompt_column",
    "eval_dataset",
    "multi_turn_scheduler",
    "external_plugins",
    "max_turns",
    "loss_scale",
    "reward_key",
}
TASK_FLAGS = {"task", "dataset", "multi_turn_scheduler"}
# options under which a checkpoint's weights load only as they were saved
FIXED = ("backend", "model")
FIXED_DEEPSPEED = ("zero_stage",)  # ZeRO partitions its files by stage and DP rank


def checkpoint_folder(path: str) -> Path:
    """A `step-NNNNNN` folder, or the newest intact one of a run folder; UsageError naming --checkpoint."""
    p = Path(path)
    if (p / checkpoint.META).is_file():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not root.is_dir():
        raise UsageError(f"--checkpoint {path}: no such folder")
    good, _ = checkpoint.newest_intact(root)
    if good is None:
        raise UsageError(f"--checkpoint {path}: holds no intact step-NNNNNN checkpoint")
    return good


def run_options(folder: Path, path: str) -> tuple[Path, dict[str, Any]]:
    """(where they were read, the options) of the run that wrote the checkpoint `folder`:
    the run's run.json, or the checkpoint's meta.json for a folder outside its run."""
    run_json = folder.parent.parent / rundir.RUN_FILE
    source, key = (run_json, None) if run_json.is_file() else (folder / checkpoint.META, "run")
    try:
        data = json.loads(source.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--checkpoint {path}: {source} is not valid JSON ({exc})") from None
    options = data.get(key) if key is not None and isinstance(data, dict) else data
    if not isinstance(options, dict):
        raise UsageError(
            f"--checkpoint {path}: {source} records no options of the run (no {rundir.RUN_FILE} beside it)"
        )
    return source, options


def typed_flags(argv: list[str]) -> set[str]:
    """The field names of the long options in `argv` (`--max-new-tokens 4`, `--seed=3`)."""
    return {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--")}


def value_of(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


# what a few training options mean here (help, default shown)
HERE = {
    "steps": ("rollout rounds, each what one training step plays", DEFAULT_ROUNDS),
    "batch_size": ("samples per rank per round: a multiple of --num-generations", None),
    "output_dir": (f"where {OUT_FILE} goes", "runs/rollouts"),
}


def help_text() -> str:
    """The usage of this script: its own options only (argparse's layout)."""
    p = parser(__doc__.split("\n\n")[0], (RolloutScriptConfig,))
    p.usage = "torchrun --nproc_per_node=N launch/rollout.py [--checkpoint RUN] [--steps N] [options]"
    p.epilog = "Every other option of a run comes from --checkpoint's run.json or --config."
    shown = USED | {"checkpoint", "config", "help"}
    for action in p._actions:
        if action.dest not in shown:
            action.help = argparse.SUPPRESS  # left out of the list
        elif action.dest in HERE:
            action.help, default = HERE[action.dest]
            action.default = default if default is not None else action.default
    return p.format_help()


def options(argv: list[str]) -> tuple[Args, Path | None, str]:
    """Parsed options, with the checkpoint's run under them; (args, checkpoint folder, what was said)."""
    refused = sorted(typed_flags(argv) & TRAINING_ONLY)
    if refused:
        what = "a training option" if len(refused) == 1 else "training options"
        raise UsageError(
            f"{', '.join(map(flag, refused))}: {what}; rollout.py does not train "
            "(launch/rollout.py --help lists its options)"
        )
    path = value_of(argv, "--checkpoint")
    folder = checkpoint_folder(path) if path else None
    run: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    origin = "task and options from the command line"
    if folder is not None:
        source, run = run_options(folder, str(path))
        skip = {"steps", "output_dir"} | (TASK_KEYS if typed_flags(argv) & TASK_FLAGS else set())
        defaults = {k: v for k, v in run.items() if k in USED - skip}
        origin = f"the run's options from {source} (the command line over them)"
    rounds_given = "steps" in typed_flags(argv)
    args = parse(
        [*argv, *([] if rounds_given else ["--steps", str(DEFAULT_ROUNDS)])],
        description=__doc__.splitlines()[0],
        extra=(RolloutScriptConfig,),
        defaults=defaults,
    )
    if folder is not None:
        check_loadable(args, run, folder)
    # no loss is computed: no reference model is built for it
    args = dataclasses.replace(args, loss=dataclasses.replace(args.loss, beta=0.0))
    rounds = f"{args.trainer.steps} round(s)" + ("" if rounds_given else " (the default; --steps N for more)")
    la = args.launch
    task = f"--dataset {la.dataset}" if la.dataset is not None else f"--task {la.task}"
    return args, folder, f"{rounds} of {task}, {origin}"


def check_loadable(args: Args, run: dict[str, Any], folder: Path) -> None:
    """UsageError naming the option under which `folder`'s weights cannot load."""
    effective = {f.name: getattr(args.backend, f.name) for f in dataclasses.fields(args.backend)}
    fixed = FIXED + (FIXED_DEEPSPEED if run.get("backend") == "deepspeed" else ())
    for name in fixed:
        if name in run and effective[name] != run[name]:
            now, then = (v if v is not None else "(the default)" for v in (effective[name], run[name]))
            raise UsageError(
                f"{flag(name)} {now}: checkpoint {folder} was trained with {flag(name)} {then}, "
                f"and its weights load only so (drop {flag(name)})"
            )
    if run.get("backend") == "deepspeed" and run.get("world_size") not in (None, world_size()):
        raise UsageError(
            f"--nproc_per_node: checkpoint {folder} is a DeepSpeed one of {run['world_size']} ranks, "
            f"this start has {world_size()}: start as many"
        )


def trajectory_record(t, advantage: float, tokenizer, step: int) -> dict:
    """One JSON-ready trajectory: text and tokens, mask, and each trained turn's logprobs."""
    logprobs = list(t.rollout_logprobs or [])
    turns, used = [], 0
    for span in t.turns:
        pairs = zip(t.token_ids[span.start : span.end], t.loss_mask[span.start : span.end])
        ids = [tok for tok, m in pairs if m]
        turns.append(
            {
                "start": span.start,
                "end": span.end,
                "text": tokenizer.decode(ids),
                "token_ids": ids,
                "logprobs": logprobs[used : used + len(ids)] if logprobs else None,
                "finish_reason": span.finish_reason,
            }
        )
        used += len(ids)
    return {
        "step": step,
        "conversation": t.infos.get("conversation"),
        "seat": t.participant,
        "group": t.group,
        "reward": t.reward,
        "advantage": advantage,
        "status": t.status.value,
        "stop_reason": t.infos.get("stop_reason"),
        "messages": t.infos.get("messages", []),
        "text": tokenizer.decode(t.token_ids),
        "token_ids": t.token_ids,
        "loss_mask": t.loss_mask,
        "turns": turns,
    }


def write_round(f: IO[str] | None, records: list[dict]) -> list[dict]:
    """Every rank's records of one round (collective); rank 0 appends them to `f`, flushed to disk."""
    everything = [r for part in distributed.all_gather_object(records) for r in part]
    if f is not None:
        f.write("".join(json.dumps(r) + "\n" for r in everything))
        f.flush()
        os.fsync(f.fileno())
    return everything


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    try:
        args, folder, said = options(argv)
        out = Path(args.trainer.output_dir or "runs/rollouts")
        if (out / OUT_FILE).exists():
            raise UsageError(f"--output-dir {out}: already holds {OUT_FILE}")
        args, source = check(args)
    except UsageError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            say(f"rollout.py: error: {exc}")
        return 2
    import torch

    torch.set_num_threads(1)
    distributed.init_distributed(timeout_s=args.trainer.collective_timeout_s)
    try:
        return play(args, source, folder, out, said)
    finally:
        distributed.destroy()


def play(args: Args, source: Any, folder: Path | None, out: Path, said: str) -> int:
    """Build the trainer, load the checkpoint, play the rounds; the exit code."""
    trainer = build_trainer(args, source)
    if folder is not None:
        trainer.backend.load(folder)
    rounds, f, bar, written = args.trainer.steps, None, None, 0
    if distributed.rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        f = (out / OUT_FILE).open("x")
        say(f"rollout.py: {said}; writing {out / OUT_FILE}")
        say(defaults.describe(args))  # the task's values, and why
        bar = progress_bar(rounds, desc="rollout")
    try:
        for step in range(rounds):
            # user code in a local phase that ends at the world check, as in training
            rollout, _ = trainer.together("rollout", trainer.scored_rollout, step)
            # an estimator's batch statistics, after the world check, as train_step runs them
            whole_batch_advantages(rollout, lambda x: distributed.all_reduce(x, "sum"))
            records = [
                trajectory_record(t, a, trainer.tokenizer, step)
                for t, a in zip(rollout.trajectories, rollout.advantages.tolist(), strict=True)
            ]
            everything = write_round(f, records)
            written += len(everything)
            if bar is not None:
                rewards = [r["reward"] for r in everything if r["reward"] is not None]
                mean = sum(rewards) / len(rewards) if rewards else None
                bar.set_postfix({"reward": fmt(mean, 3), "trajectories": written})
                bar.update(1)
    except distributed.WorldFailure as exc:  # on every rank: its last line names the cause
        say(f"rollout.py: error: {exc}")
        distributed.barrier_or_gone(trainer.world_check)
        return 1
    finally:
        if bar is not None:
            bar.close()
        if f is not None:
            f.close()
        trainer.close()  # a colocated vLLM shut down before the process groups go
    if distributed.rank() == 0:
        say(f"wrote {written} trajectories to {out / OUT_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
