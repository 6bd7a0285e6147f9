"""Train a policy with GRPO on multi-turn rollouts (default: guess-a-number, tiny model, CPU).

    torchrun --nproc_per_node=2 launch/train_grpo.py
    torchrun --nproc_per_node=2 launch/train_grpo.py --backend deepspeed --zero-stage 3
    torchrun --nproc_per_node=2 launch/train_grpo.py --output-dir runs/grpo --resume
    torchrun --nproc_per_node=2 --max-restarts 3 launch/train_grpo.py --output-dir runs/grpo --resume auto
    torchrun --nproc_per_node=2 launch/train_grpo.py --task mymodule:make_tasks --reward mymodule:reward
    torchrun --nproc_per_node=2 launch/train_grpo.py --config run.yaml --steps 20
    python launch/run.py --nproc_per_node=2 launch/train_grpo.py ...   # torchrun, exit codes kept

Writes OUTPUT_DIR (default: a new runs/<task>-<timestamp>): run.json (the effective options),
metrics.jsonl, completions.jsonl, reward.png, tensorboard/ or wandb/ with --report-to, and
checkpoints/step-NNNNNN (atomic; --resume continues from the newest). Bad input: one line on
stderr, exit code 2, nothing written (docs/bad-input.md lists each). SIGTERM or Ctrl-C: the
step finishes, is saved, and the run exits 0 (--save-on-signal). `--help` lists every option
with its default.
"""

from __future__ import annotations

import os
import sys

from interlens_mcore import distributed
from interlens_mcore.cli import (
    defaults,
    quiet,  # noqa: F401  (before megatron / DeepSpeed are imported)
    refusal,
    sizes,
)
from interlens_mcore.cli.args import UsageError, parse
from interlens_mcore.cli.build import build_trainer, check
from interlens_mcore.cli.lines import say
from trainers import preemption, state
from trainers.checkpoint import ResumeRefused
from trainers.report import record
from trainers.report.failures import TooManyFailures
from trainers.rundir import RunDirError


def _say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        say(f"train_grpo.py: {' '.join(message.split())}")


def _refuse(message: str) -> int:
    """One line, exit code 2; kept for torchrun's restarts of this run (see cli/refusal.py)."""
    _say(f"error: {message}")
    refusal.record(message)
    return 2


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        preemption.release()  # the caller's own signal handlers again


def _main(argv: list[str] | None) -> int:
    if refusal.recorded() is not None:  # a restart of a refused run: its line was printed once
        return 2
    try:
        args = parse(argv, description=__doc__.splitlines()[0])
        if args.trainer.save_on_signal:
            preemption.hold()  # a signal during start-up stops the run at its first step boundary
        args, source = check(args)  # every check that needs no process group
        try:
            distributed.check_restartable(os.environ)  # torchrun's own settings
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        # decided before any rank can write run.json (that waits for the process group), so
        # every rank of a restarted or a fresh `--resume auto` run decides alike
        resume = args.launch.resuming(args.trainer.output_dir)
    except UsageError as exc:
        return _refuse(str(exc))
    import torch

    torch.set_num_threads(1)  # ranks share the cores; one intra-op thread each
    distributed.init_distributed(timeout_s=args.trainer.collective_timeout_s)
    trainer = None
    try:
        trainer = build_trainer(args, source)
        try:
            start = trainer.resume() if resume else 0  # a refusal here is the run's only line
            if distributed.rank() == 0:
                say(defaults.describe(args))  # what is not a plain default, and why
            if args.launch.eval_only:
                return _evaluate_only(trainer, args.trainer.output_dir)
            if distributed.rank() == 0 and not args.launch.eval_only:
                say(f"config: {trainer.run_info}")
                slow = sizes.slow_bf16(args)
                if slow:
                    say(f"warning: {slow}")
                if start:
                    say(f"resuming at step {start} of {args.trainer.steps}")
            trainer.train()
        except (ResumeRefused, RunDirError, TooManyFailures) as exc:  # every rank raises it together
            return _refuse(str(exc))
        except distributed.WorldFailure as exc:  # on every rank: its last line names the cause
            say(f"train_grpo.py: error: {exc}")
            # no rank leaves before every rank has said it (torchrun stops the others at the
            # first exit); a peer that is already gone ends the wait at once
            distributed.barrier_or_gone(trainer.world_check)
            return 1
        except KeyboardInterrupt:  # a second Ctrl-C: the user wants out now
            _say("interrupted: stopped without a checkpoint of this step; --resume continues from the newest")
            return 130
        if trainer.stop.stopped:
            _say(_stopped(trainer, start))
            return 0
        if args.launch.export_hf:
            trainer.export_hf(args.launch.export_hf)
    finally:
        if trainer is not None:
            trainer.close()  # vLLM's shutdown first: it destroys the process groups it shares with us
        distributed.destroy()
    return 0


def _evaluate_only(trainer, output_dir: str | None) -> int:
    """--eval-only: the held-out rows once with the loaded weights; the summary on stderr, one JSON
    line on stdout (and appended to OUTPUT_DIR/eval.jsonl); nothing trained, no checkpoint."""
    import json
    from pathlib import Path

    try:
        figures = trainer.evaluation()
    finally:
        state.release_output_dir(trainer)  # a --resume took the run's folder lock
    if not figures:
        return _refuse(f"--eval-only: task {trainer.tasks.name} has no held-out rows to evaluate")
    line = json.dumps(record.json_ready({"step": trainer.step, **figures}))
    if distributed.rank() == 0:
        # the counts too: a rate's sample count and the failed samples say what it was taken over
        shown = ", ".join(f"{k} {v:.4g}" for k, v in figures.items() if isinstance(v, int | float))
        _say(f"eval-only at step {trainer.step} ({trainer.tasks.name}): {shown}")
        print(line, flush=True)
        if output_dir is not None:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(output_dir) / "eval.jsonl", "a") as f:
                f.write(line + "\n")
    return 0


def _stopped(trainer, start: int) -> str:
    """The one line of a run stopped by a signal at a step boundary."""
    steps, name = trainer.config.steps, trainer.stop.name
    if trainer.step == start:
        return f"stopped by {name} before step {start} of {steps}: nothing new to save; --resume continues"
    saved = trainer.checkpoint_root / f"step-{trainer.step:06d}"
    return f"stopped by {name} after step {trainer.step} of {steps}: saved {saved}; --resume continues"


if __name__ == "__main__":
    sys.exit(main())
