"""Train a policy with GRPO on multi-turn rollouts (default: guess-a-number, tiny model, CPU).

    torchrun --nproc_per_node=2 launch/train_grpo.py
    torchrun --nproc_per_node=2 launch/train_grpo.py --backend deepspeed --zero-stage 3
    torchrun --nproc_per_node=2 launch/train_grpo.py --output-dir runs/grpo --resume
    torchrun --nproc_per_node=2 --max-restarts 3 launch/train_grpo.py --output-dir runs/grpo --resume auto
    torchrun --nproc_per_node=2 launch/train_grpo.py --task mymodule:make_tasks --reward mymodule:reward
    torchrun --nproc_per_node=2 launch/train_grpo.py --config run.yaml --steps 20

Writes OUTPUT_DIR (default: a new runs/<task>-<timestamp>): run.json (the effective options),
metrics.jsonl, completions.jsonl, reward.png, tensorboard/ or wandb/ with --report-to, and
checkpoints/step-NNNNNN (atomic; --resume continues from the newest). Bad input: one line on
stderr, exit code 2, nothing written. `--help` lists every option with its default.
"""

from __future__ import annotations

import os
import sys

from interlens_mcore import distributed
from interlens_mcore.cli import quiet  # noqa: F401  (before megatron / DeepSpeed are imported)
from interlens_mcore.cli.args import UsageError, parse
from interlens_mcore.cli.build import build_trainer, check
from trainers.checkpoint import NoIntactCheckpoint
from trainers.rundir import RunDirError


def _say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"train_grpo.py: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv, description=__doc__.splitlines()[0])
        source = check(args)  # every check that needs no process group
        # decided before any rank can write run.json (that waits for the process group), so
        # every rank of a restarted or a fresh `--resume auto` run decides alike
        resume = args.launch.resuming(args.trainer.output_dir)
    except UsageError as exc:
        _say(str(exc))
        return 2
    import torch

    torch.set_num_threads(1)  # ranks share the cores; one intra-op thread each
    distributed.init_distributed(timeout_s=args.trainer.collective_timeout_s)
    try:
        trainer = build_trainer(args, source)
        if distributed.rank() == 0:
            print(f"config: {trainer.run_info}", file=sys.stderr)
        try:
            start = trainer.resume() if resume else 0
            if distributed.rank() == 0 and start:
                print(f"resuming at step {start} of {args.trainer.steps}", file=sys.stderr)
            trainer.train()
        except (NoIntactCheckpoint, RunDirError) as exc:  # every rank raises it together
            _say(str(exc))
            return 2
        except distributed.WorldFailure as exc:  # on every rank: its last line names the cause
            print(f"train_grpo.py: error: {exc}", file=sys.stderr, flush=True)
            # no rank leaves before every rank has said it (torchrun stops the others at the
            # first exit); a peer that is already gone ends the wait at once
            distributed.barrier_or_gone(trainer.world_check)
            return 1
        if args.launch.export_hf:
            trainer.export_hf(args.launch.export_hf)
    finally:
        distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
