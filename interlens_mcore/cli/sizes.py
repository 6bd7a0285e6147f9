"""Checks against the machine, made before anything is written: --output-dir and the sizes.

A size that cannot fit (`--batch-size 4000000000000000`) would otherwise pass every check and
grow until the machine runs out of memory. The bound here is a lower one: every trajectory of
a step, and of an evaluation, holds at least `SAMPLE_BYTES` of Python objects (a trajectory of
one token alone measures about 830 bytes), on every rank of this machine at once. A size it
accepts may still not fit; one it refuses cannot.
"""

from __future__ import annotations

import os
from pathlib import Path

from interlens_mcore.cli.args import Args, UsageError
from interlens_mcore.tasks import TaskSource

SAMPLE_BYTES = 512
# kernel filesystems: their folders refuse new files even to root, whatever their modes say
_KERNEL_FILESYSTEMS = {"proc", "sysfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs"}


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_sizes(args: Args, source: TaskSource) -> None:
    """UsageError naming the flag when one step's samples, or the held-out rows, cannot fit."""
    t = args.trainer
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks sharing this machine's memory
    seats = len(source.trained_seats)
    memory = machine_memory()
    wanted = {
        "--batch-size": (t.batch_size, t.batch_size * seats, "trajectories per rank per step"),
        "--eval-size": (t.eval_size, t.eval_size * seats, "held-out trajectories per rank"),
    }
    for name, (value, samples, what) in wanted.items():
        need = samples * SAMPLE_BYTES * local
        if need > memory:
            raise UsageError(
                f"{name} {value}: {samples:,} {what} on {local} rank(s) need at least {_gib(need)}, "
                f"more than this machine's {_gib(memory)} of memory"
            )


def check_output_dir(path: Path) -> None:
    """UsageError unless --output-dir is, or can be made, a folder this process may write to."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"--output-dir {path}: exists and is not a folder")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"--output-dir {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--output-dir {path}: {existing} is not writable by this user")
    kind = _filesystem(existing)
    if kind in _KERNEL_FILESYSTEMS:
        raise UsageError(f"--output-dir {path}: {existing} is on the kernel's {kind} filesystem (no files)")


def _filesystem(path: Path) -> str | None:
    """The type of the filesystem `path` is on (Linux's /proc/self/mounts), or None."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    resolved = path.resolve()
    best: tuple[str | None, int] = (None, -1)
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = Path(parts[1].replace("\\040", " "))
        if (resolved == point or point in resolved.parents) and len(point.parts) > best[1]:
            best = (parts[2], len(point.parts))
    return best[0]


# the x86 flags of CPUs with bfloat16 matrix instructions (Linux's names in /proc/cpuinfo)
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def slow_bf16(args: Args, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The warning for `--bf16` on a CPU without bfloat16 instructions, or None.

    There autocast's bfloat16 matmuls are emulated: on one 2-core AMD EPYC without them a
    [1000, 576] x [576, 1536] product took 0.146 s against 0.026 s in float32. Unknown CPUs (no
    readable `cpuinfo`, another architecture) and GPUs get no warning.
    """
    import torch

    if not args.backend.bf16 or torch.cuda.is_available():
        return None
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags = {
        f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()
    }
    if not flags or "avx2" not in flags or flags.intersection(BF16_FLAGS):
        return None  # not an x86 flags list, or bfloat16 in hardware
    return (
        "--bf16 on a CPU without bfloat16 instructions (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): "
        "autocast's bfloat16 matmuls are emulated and run several times slower than float32 here; "
        "drop --bf16 (or set bf16: false in the --config file)"
    )
