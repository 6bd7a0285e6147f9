"""Write a task's own demonstrations as JSONL, for a supervised warm-up (`--sft-data`).

    python launch/demos.py --task guess --n 256 --out demos.jsonl
    torchrun --nproc_per_node=2 launch/train_grpo.py --task guess --sft-data demos.jsonl --sft-steps 50

One OpenAI message list a line (the task's prompt, then the solver's turns and the
environment's answers), so the file can be read and edited before training on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from interlens_mcore.tasks.families import parse_task_args
    from interlens_mcore.tasks.registry import resolve_task

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, help="a task name or MODULE:FACTORY, as train_grpo.py takes")
    p.add_argument("--task-arg", action="append", default=[], help="KEY=VALUE, as train_grpo.py takes")
    p.add_argument("--n", type=int, default=256, help="demonstrations to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the JSONL file written")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error(f"--n must be >= 1, got {args.n}")
    try:
        source = resolve_task(args.task, parse_task_args(args.task_arg))
        demos = source.demonstrations(args.n, seed=args.seed)
    except (NotImplementedError, ValueError) as exc:
        print(f"launch/demos.py: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.write_text("".join(json.dumps(d) + "\n" for d in demos))
    print(f"{len(demos)} demonstrations of {args.task} in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
