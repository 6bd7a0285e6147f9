"""A trainer's persistent state: its claim on the output folder, checkpoints, and resuming.

Collective over the world: rank 0 decides (claims the folder, picks the checkpoint), every rank
learns the decision, and an error is raised on every rank together.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from interlens_mcore import distributed

from . import checkpoint, rundir


def claim_output_dir(out: Path, run: dict, *, resume: bool):
    """Rank 0 claims `out` for this run (see rundir.claim); a refusal raises on every rank."""
    lock, error = None, None
    if distributed.rank() == 0:
        try:
            lock = rundir.claim(out, run, resume=resume)
        except rundir.RunDirError as exc:
            error = str(exc)
    error = distributed.all_gather_object(error)[0]
    if error is not None:
        raise rundir.RunDirError(error)
    return lock


def save_checkpoint(trainer: Any) -> Path:
    def write(folder: Path) -> None:
        trainer.backend.save(folder)
        own = {"step": trainer.step, "rng": checkpoint.rng_state(), "skipped_steps": trainer.skipped_steps}
        torch.save(own, folder / f"trainer-rank{trainer.groups.rank:05d}.pt")

    return checkpoint.save(
        trainer.checkpoint_root,
        trainer.step,
        write,
        meta={"run": trainer.run_info},
        keep=trainer.config.save_total_limit,
    )


def resume(trainer: Any) -> int:
    """Load the newest intact checkpoint, if any; returns the step to continue from.

    Rank 0 verifies the checkpoints newest first against their manifests and renames a corrupt
    one to `corrupt-step-NNNNNN` (kept for inspection, never chosen again); every rank then loads
    the one it chose. `checkpoint.NoIntactCheckpoint` (a ValueError) on every rank when
    checkpoints exist but none is intact.
    """
    root = trainer.checkpoint_root
    choice: tuple[str | None, str | None] = (None, None)  # (folder name, error)
    if distributed.rank() == 0:
        checkpoint.clean_stale(root)
        choice = _choose(root)
    name, error = distributed.all_gather_object(choice)[0]  # everyone loads the same step, or raises
    if error is not None:
        raise checkpoint.NoIntactCheckpoint(error)
    if name is None:
        return trainer.step
    folder = root / name
    trainer.backend.load(folder)
    own = torch.load(folder / f"trainer-rank{trainer.groups.rank:05d}.pt", weights_only=False)
    checkpoint.set_rng_state(own["rng"])
    trainer.step = int(own["step"])
    trainer.skipped_steps = int(own["skipped_steps"])
    return trainer.step


def _choose(root: Path) -> tuple[str | None, str | None]:
    """(newest intact checkpoint's name or None, error or None); says why on stderr (rank 0)."""
    good, bad = checkpoint.newest_intact(root)
    then = f"resuming from {good.name}" if good is not None else "no intact checkpoint is left"
    for name, reason, kept in bad:
        print(f"checkpoint {name} is corrupt ({reason}), kept as {kept}; {then}", file=sys.stderr)
    set_aside = checkpoint.corrupt(root)  # this run's and earlier runs' corrupt checkpoints
    if good is None and set_aside:
        return None, (
            f"no intact checkpoint in {root} to resume from; set aside as corrupt: {', '.join(set_aside)}. "
            f"Delete them to train this run again from step 0 with --resume, or train into a new --output-dir"
        )
    return (good.name if good is not None else None), None
