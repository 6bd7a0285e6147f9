"""Run the launch scripts as a user would: torchrun (or python) in a subprocess with a deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "launch" / "train_grpo.py"
# a few small steps: every test run stays well under a minute on 2 cores
SMALL = ["--batch-size", "8", "--num-generations", "4", "--max-new-tokens", "4", "--save-every", "2"]


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    e.update(extra)
    return e


def torchrun(
    *args: str, nproc: int = 2, timeout: float = 240, script: Path = TRAIN
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
    ]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env(), cwd=ROOT)


def python(*args: str, timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(TRAIN), *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env(**extra_env), cwd=ROOT
    )


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
