"""A GRPO training step broken into rollout, batch building, forward/backward and optimizer.

    torchrun --nproc_per_node=2 benchmarks/bench_train_step.py --backend megatron --tp 1 --json
    torchrun --nproc_per_node=2 benchmarks/bench_train_step.py --backend deepspeed --zero-stage 3 --json

Builds the trainer exactly as launch/train_grpo.py does (interlens_mcore.cli.args and .build)
and times its phases by wrapping them on the instance; the trainer is not changed.
The first step is a warm-up; medians over the rest. Rank 0 prints one JSON object last.
Other options are passed through to launch/train_grpo.py's parser (e.g. --batch-size 16).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict

import torch
from common import emit, median

import trainers.grpo
from interlens_mcore import distributed
from interlens_mcore.cli.args import parse
from interlens_mcore.cli.build import build_trainer, check

# what each timed call counts toward
BACKEND_PHASES = {
    "logprobs_of": "forward_backward",
    "backward": "forward_backward",
    "optimizer_step": "optimizer",
}


def instrument(trainer) -> tuple[list[dict], list[float]]:
    """Wrap the trainer's phases on the instance; returns (one dict per step, step wall times)."""
    current: dict[str, float] = defaultdict(float)
    steps: list[dict] = []
    walls: list[float] = []
    for method, phase in BACKEND_PHASES.items():
        setattr(trainer.backend, method, _timed(getattr(trainer.backend, method), phase, current))
    trainer.scored_rollout = _timed(trainer.scored_rollout, "rollout", current)
    # batch building is a module function of the loop
    trainers.grpo.micro_batches = _timed(trainers.grpo.micro_batches, "batch", current)
    step = trainer.train_step

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        walls.append(time.perf_counter() - t0)
        # the work the step did: its replies' mean length in tokens (a model may stop early)
        current["completion_tokens"] = out[0].get("completions/mean_length", 0.0)
        steps.append(dict(current))
        current.clear()
        return out

    trainer.train_step = timed_step
    return steps, walls


def _timed(fn, phase: str, into: dict):
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        into[phase] += time.perf_counter() - t0
        return out

    return wrapped


def summarize(steps: list[dict], walls: list[float]) -> dict:
    measured = steps[1:] or steps  # the first step compiles, allocates and warms caches
    phases = ("rollout", "batch", "forward_backward", "optimizer")
    out = {f"{p}_s": median([s.get(p, 0.0) for s in measured]) for p in phases}
    out["step_s"] = median(walls[1:] or walls)
    out["other_s"] = round(out["step_s"] - sum(out[f"{p}_s"] for p in phases), 4)
    out["completion_tokens_mean"] = median([s.get("completion_tokens", 0.0) for s in measured])
    return out


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads a rank (ranks share the cores)")
    args, rest = ap.parse_known_args(argv)
    out_dir = tempfile.mkdtemp(prefix="bench_train_step.")
    flags = [*rest, "--steps", str(args.steps), "--save-every", "1000000", "--eval-every", "0"]
    opts = parse([*flags, "--output-dir", out_dir], "bench")
    opts, source = check(opts)  # with the task's defaults applied, as launch/train_grpo.py does
    torch.set_num_threads(args.threads)  # 1 by default: ranks share the cores, as in launch/train_grpo.py
    distributed.init_distributed(timeout_s=opts.trainer.collective_timeout_s)
    try:
        trainer = build_trainer(opts, source)
        steps, walls = instrument(trainer)
        trainer.train()
        b = opts.backend
        label = f"megatron tp={b.tp} dp={distributed.world_size() // b.tp}"
        if b.backend == "deepspeed":
            label = f"deepspeed zero-{b.zero_stage} dp={distributed.world_size()}"
        out = {"config": label, "ranks": distributed.world_size(), "steps": args.steps}
        out.update(
            batch_size=opts.trainer.batch_size,
            num_generations=opts.rollout.num_generations,
            **summarize(steps, walls),
        )
        return emit(out, args.json) if distributed.rank() == 0 else None
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main()
