"""A GRPO training step broken into rollout, batch building, forward/backward and optimizer.

    torchrun --nproc_per_node=2 benchmarks/bench_train_step.py --backend megatron --tp 1 --json
    torchrun --nproc_per_node=2 benchmarks/bench_train_step.py --backend deepspeed --zero-stage 3 --json

Builds the trainer exactly as launch/train_grpo.py does (its options and backends modules) and
times the trainer's own methods by wrapping them on the instance; the trainers are not changed.
The first step is a warm-up; medians over the rest. Rank 0 prints one JSON object last.
Other options are passed through to launch/train_grpo.py's parser (e.g. --batch-size 16).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict

import torch
from common import ROOT, emit, median

sys.path.insert(0, str(ROOT / "launch"))

from backends import build_trainer  # noqa: E402
from options import parse, validate  # noqa: E402

from interlens_mcore import parallel  # noqa: E402

PHASES = {
    "generate_rollouts": "rollout",
    "training_batches": "batch",
    "policy_logprobs": "forward_backward",
    "reference_logprobs": "forward_backward",
    "backward": "forward_backward",
    "optimizer_step": "optimizer",
}


def instrument(trainer) -> list[dict]:
    """Wrap the phase methods of `trainer`; returns the list that collects one dict per step."""
    current: dict[str, float] = defaultdict(float)
    steps: list[dict] = []
    for method, phase in PHASES.items():
        setattr(trainer, method, _timed(getattr(trainer, method), phase, current))
    record = trainer.step_record

    def step_record(*args, **kwargs):  # called once per step, after the optimizer
        steps.append(dict(current))
        current.clear()
        return record(*args, **kwargs)

    trainer.step_record = step_record
    return steps


def _timed(fn, phase: str, into: dict):
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        into[phase] += time.perf_counter() - t0
        return out

    return wrapped


def summarize(steps: list[dict], walls: list[float]) -> dict:
    measured = steps[1:] or steps  # the first step compiles, allocates and warms caches
    out = {f"{p}_s": median([s.get(p, 0.0) for s in measured]) for p in dict.fromkeys(PHASES.values())}
    out["step_s"] = median(walls[1:] or walls)
    out["other_s"] = round(out["step_s"] - sum(out[f"{p}_s"] for p in dict.fromkeys(PHASES.values())), 4)
    return out


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args, rest = ap.parse_known_args(argv)
    out_dir = tempfile.mkdtemp(prefix="bench_train_step.")
    opts = parse(
        [*rest, "--steps", str(args.steps), "--save-every", "1000000", "--output-dir", out_dir], "bench"
    )
    validate(opts)
    torch.set_num_threads(1)  # ranks share the cores, as in launch/train_grpo.py
    parallel.init_distributed()
    try:
        trainer = build_trainer(opts, {"bench": True})
        steps = instrument(trainer)
        walls, t0 = [], time.perf_counter()
        trainer.save_checkpoint = lambda: None  # checkpoint writes are not part of a step
        record = trainer.step_record

        def stamp(*a, **k):
            nonlocal t0
            walls.append(time.perf_counter() - t0)
            out = record(*a, **k)
            t0 = time.perf_counter()
            return out

        trainer.step_record = stamp
        trainer.train()
        label = f"megatron tp={opts.tp} dp={parallel.world_size() // opts.tp}"
        if opts.backend == "deepspeed":
            label = f"deepspeed zero-{opts.zero_stage} dp={parallel.world_size()}"
        out = {"config": label, "ranks": parallel.world_size(), "steps": args.steps}
        out.update(
            batch_size=opts.batch_size, num_generations=opts.num_generations, **summarize(steps, walls)
        )
        return emit(out, args.json) if parallel.rank() == 0 else None
    finally:
        parallel.destroy()


if __name__ == "__main__":
    main()
