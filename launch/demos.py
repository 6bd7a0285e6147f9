"""Write a task's own demonstrations as JSONL, for a supervised warm-up (`--sft-data`).

    python launch/demos.py --n 256 --out demos.jsonl --task guess
    torchrun --nproc_per_node=2 launch/train_grpo.py --task guess --sft-data demos.jsonl --sft-steps 50

    python launch/demos.py --n 128 --out calc.jsonl --task reasoning_gym:basic_arithmetic \\
        --tools interlens_mcore.tools.examples:calculator --model smollm2

Every option other than `--n`, `--seed` and `--out` is train_grpo.py's own, read the same way
(`--config run.yaml` too): pass the options of the run the demonstrations are for, and the
conversations open as its rollouts do (the same `--system-prompt`, the same tool descriptions
rendered for `--model`'s chat template). One OpenAI message list a line (the task's prompt, then
the solver's turns and the environment's answers), so the file can be read and edited before
training on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from interlens_mcore.cli.args import UsageError, parse
    from interlens_mcore.cli.build import add_tools, with_task_defaults

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False, add_help=False)
    p.add_argument("--n", type=int, default=256, help="demonstrations to write")
    p.add_argument("--seed", type=int, default=0, help="the demonstrations' seed (0)")
    p.add_argument("--out", help="the JSONL file written")
    p.add_argument("-h", "--help", action="store_true")
    own, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if own.help:
        p.print_help()
        print("\nand train_grpo.py's options (python launch/train_grpo.py --help)")
        return 0
    if own.out is None:
        return _refuse("--out FILE is required: the JSONL file the demonstrations are written to")
    if own.n < 1:
        return _refuse(f"--n must be >= 1, got {own.n}")
    try:
        args, base = with_task_defaults(parse(rest, description=__doc__.splitlines()[0]))
        source = add_tools(args, base)
        demos = source.demonstrations(own.n, seed=own.seed)
    except (UsageError, NotImplementedError, ValueError) as exc:
        return _refuse(str(exc))
    out = Path(own.out)
    out.write_text("".join(json.dumps(d) + "\n" for d in demos))
    print(f"launch/demos.py: {len(demos)} demonstrations of {source.name} in {out}", file=sys.stderr)
    return 0


def _refuse(message: str) -> int:
    print(f"launch/demos.py: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
