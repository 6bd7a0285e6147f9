"""Train a policy with GRPO on multi-turn rollouts (default: guess-a-number, tiny model, CPU).

    torchrun --nproc_per_node=2 launch/train_grpo.py --output-dir runs/grpo
    torchrun --nproc_per_node=2 launch/train_grpo.py --backend deepspeed --zero-stage 3
    torchrun --nproc_per_node=2 launch/train_grpo.py --output-dir runs/grpo --resume
    torchrun --nproc_per_node=2 launch/train_grpo.py --config run.yaml --steps 20

Writes OUTPUT_DIR/run.json (the options), metrics.jsonl (one line per step), reward.png and
checkpoints/step-NNNNNN (atomic; --resume continues from the newest to the same final step).
Bad input: one line on stderr, exit code 2, nothing written.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# the repository root, for `interlens_mcore` and `trainers` when the package is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from backends import build_trainer, configs, import_backend  # noqa: E402
from options import (  # noqa: E402
    UsageError,
    check_output_dir,
    hold_lock,
    parse,
    run_identity,
    validate,
    world_size,
)

from interlens_mcore import parallel  # noqa: E402
from trainers.base import write_json_atomic  # noqa: E402
from trainers.checkpoint import NoIntactCheckpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse(argv, description=__doc__.splitlines()[0])
        validate(opts)
        configs(opts)  # the configs' own checks, before any process group exists
        run = {**run_identity(opts), "world_size": world_size()}
        check_output_dir(opts, run)
        lock = hold_lock(Path(opts.output_dir)) if os.environ.get("RANK", "0") == "0" else None
    except UsageError as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"train_grpo.py: error: {exc}", file=sys.stderr)
        return 2
    import_backend(opts)
    torch.set_num_threads(1)  # ranks share the cores; one intra-op thread each
    parallel.init_distributed()
    try:
        if parallel.rank() == 0:
            write_json_atomic(Path(opts.output_dir) / "run.json", run)
        trainer = build_trainer(opts, run)
        try:
            start = trainer.resume() if opts.resume else 0
        except NoIntactCheckpoint as exc:  # every rank raises it together
            if parallel.rank() == 0:
                print(f"train_grpo.py: error: {exc}", file=sys.stderr)
            return 2
        if parallel.rank() == 0 and start:
            print(f"resuming at step {start} of {opts.steps}", file=sys.stderr)
        trainer.train()
        if opts.export_hf:
            trainer.export_hf(opts.export_hf)
    finally:
        parallel.destroy()
        if lock is not None:
            lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
