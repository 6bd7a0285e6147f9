"""Atomic checkpoints: every rank writes into a temporary folder, then rank 0 renames it.

A folder named `step-NNNNNN` exists only once every rank's files and `meta.json` are in it
(a rename within one filesystem is atomic), so a run killed at any moment never leaves a
checkpoint that `latest` would return half-written. Stale temporary folders are removed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from interlens_mcore import parallel

PREFIX, TMP_PREFIX = "step-", ".tmp-step-"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:06d}"


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / "meta.json").is_file())
    return done[-1] if done else None


def save(root: Path, step: int, write: Callable[[Path], None], *, meta: dict, keep: int = 2) -> Path:
    """Collective: `write(tmp_folder)` on every rank, then publish as `step-NNNNNN`."""
    tmp = root / f"{TMP_PREFIX}{step:06d}"
    if parallel.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    parallel.barrier()
    write(tmp)
    parallel.barrier()  # every rank's files are on disk before the folder is published
    final = step_dir(root, step)
    if parallel.rank() == 0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        older = sorted(p for p in root.iterdir() if p.name.startswith(PREFIX) and p != final)
        for p in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
    parallel.barrier()
    return final


def clean_stale(root: Path) -> None:
    """Remove temporary folders a killed run left behind (rank 0 only; call before a barrier)."""
    if parallel.rank() == 0 and root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
