"""A trainer's persistent state: its claim on the output folder, checkpoints, and resuming.

Collective over the world: rank 0 decides (claims the folder, picks the checkpoint), every rank
learns the decision, and an error is raised on every rank together. The folder's lock is taken
before anything in it is read or removed, so a resumption never touches a live run's files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from interlens_mcore import distributed
from interlens_mcore.cli.lines import say
from interlens_mcore.distributed.safe_load import UnsafeCheckpoint, check_checkpoint

from . import checkpoint, own_state, rundir
from .backends.base import Backend
from .config import TrainerConfig
from .kl_reward import KLController
from .report.reporter import METRICS_FILE, read_jsonl


class Persistent(Protocol):
    """What of a trainer its persistent state reads and sets (GRPOTrainer is one)."""

    config: TrainerConfig
    backend: Backend
    groups: distributed.ParallelGroups
    output_dir: Path
    run_info: dict[str, object]
    step: int
    skipped_steps: int
    kl_control: KLController | None
    sft_step: int
    resumed: bool
    claim: FolderClaim | None

    @property
    def checkpoint_root(self) -> Path: ...


@dataclass
class FolderClaim:
    """This process's hold on the output folder: rank 0's open `.lock` (None on other ranks)."""

    handle: IO | None

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()


def take_output_dir(trainer: Persistent, *, resume: bool) -> FolderClaim:
    """Rank 0 locks and checks the folder (rundir.lock) unless this trainer holds it already."""
    if trainer.claim is None:
        handle, error = None, None
        if distributed.rank() == 0:
            try:
                handle = rundir.lock(trainer.output_dir, trainer.run_info, resume=resume)
            except rundir.RunDirError as exc:
                error = str(exc)
        error = distributed.all_gather_object(error)[0]
        if error is not None:
            raise rundir.RunDirError(error)
        trainer.claim = FolderClaim(handle)
    return trainer.claim


def claim_output_dir(trainer: Persistent) -> FolderClaim:
    """The folder taken for training: locked (see `take_output_dir`), `run.json` written."""
    claim = take_output_dir(trainer, resume=trainer.resumed)
    if distributed.rank() == 0:
        rundir.write_json_atomic(trainer.output_dir / rundir.RUN_FILE, trainer.run_info)
        # present from the start: a resumption that finds it missing knows it was deleted
        trainer.checkpoint_root.mkdir(exist_ok=True)
    return claim


def release_output_dir(trainer: Persistent) -> None:
    if trainer.claim is not None:
        trainer.claim.release()
        trainer.claim = None


def save_checkpoint(trainer: Persistent) -> Path:
    def write(folder: Path) -> None:
        trainer.backend.save(folder)
        coef = trainer.kl_control.value if trainer.kl_control is not None else None
        own = own_state.TrainerState.capture(
            step=trainer.step, skipped_steps=trainer.skipped_steps, kl_coef=coef, sft_step=trainer.sft_step
        )
        own.write(folder, trainer.groups.rank)

    final = checkpoint.save(
        trainer.checkpoint_root,
        trainer.step,
        write,
        meta={"run": trainer.run_info},
        keep=trainer.config.save_total_limit,
    )
    if distributed.rank() == 0:
        last = {"step": trainer.step, "name": final.name}
        rundir.write_json_atomic(trainer.output_dir / rundir.LAST_CHECKPOINT_FILE, last)
    return final


def save_on_stop(trainer: Persistent, start: int) -> None:
    """A run stopped at a step boundary saves its last step, unless the loop just did (or ran none)."""
    cfg = trainer.config
    if trainer.step != start and trainer.step % cfg.save_every and trainer.step != cfg.steps:
        save_checkpoint(trainer)


def resume(trainer: Persistent) -> int:
    """Load the newest intact checkpoint, if any; returns the step to continue from.

    The folder is locked first. Rank 0 verifies the checkpoints newest first against their
    manifests and renames a corrupt one to `corrupt-step-NNNNNN` (kept for inspection, never
    chosen again); every rank then loads the one it chose, and a load that fails on any rank
    sets it aside too and tries the one before. Raises on every rank: `checkpoint.ResumeRefused`
    when checkpoints exist but none is intact, when the run's newest checkpoint is gone, or
    when the one chosen holds a pickle that loading would run (nothing of it is loaded then).
    """
    take_output_dir(trainer, resume=True)
    root = trainer.checkpoint_root
    if distributed.rank() == 0:
        checkpoint.clean_stale(root)
    while True:
        choice: tuple[str | None, str | None] = (None, None)  # (folder name, refusal)
        if distributed.rank() == 0:
            choice = _choose(trainer)
        name, refusal = distributed.all_gather_object(choice)[0]  # everyone loads the same step, or raises
        if refusal is not None:
            raise checkpoint.ResumeRefused(refusal)
        if name is None:
            return trainer.step
        failures = distributed.all_gather_object(_load(trainer, root / name))
        failed = [(r, f) for r, f in enumerate(failures) if f is not None]
        if not failed:
            return trainer.step
        if distributed.rank() == 0:
            kept = checkpoint.set_aside(root, root / name)
            r, why = failed[0]
            say(f"checkpoint {name} does not load (rank {r}: {why}), kept as {kept}")


def _load(trainer: Persistent, folder: Path) -> str | None:
    """Load `folder` into the backend and the trainer; None, or why it failed on this rank."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        trainer.backend.load(folder)  # first on every rank: it is collective
        own = own_state.read(folder, trainer.groups.rank)
    except (Exception, CheckpointException) as exc:  # reported to every rank: set aside
        return _describe(exc)
    own.restore()
    trainer.step, trainer.skipped_steps, trainer.sft_step = own.step, own.skipped_steps, own.sft_step
    if trainer.kl_control is not None and own.kl_coef is not None:  # an adapted coefficient goes on
        trainer.kl_control.value = own.kl_coef
    return None


def _describe(exc: BaseException) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:  # DCP wraps each rank's error
        exc = next(iter(exc.failures.values()))[0]
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def _choose(trainer: Persistent) -> tuple[str | None, str | None]:
    """(newest intact checkpoint's name or None, refusal or None); says why on stderr (rank 0)."""
    root = trainer.checkpoint_root
    good, bad = checkpoint.newest_intact(root)
    then = f"resuming from {good.name}" if good is not None else "no intact checkpoint is left"
    for name, reason, kept in bad:
        say(f"checkpoint {name} is corrupt ({reason}), kept as {kept}; {then}")
    set_aside = checkpoint.corrupt(root)  # this run's and earlier runs' corrupt checkpoints
    if good is None and set_aside:
        return None, (
            f"no intact checkpoint in {root} to resume from; set aside as corrupt: {', '.join(set_aside)}. "
            f"Delete them to train this run again from step 0 with --resume, or train into a new --output-dir"
        )
    gone = _gone(trainer, good, set_aside)
    if gone is not None:
        return None, gone
    if good is not None:
        try:
            check_checkpoint(good)
        except UnsafeCheckpoint as exc:
            return None, (
                f"checkpoint {good} is refused: {exc}; nothing of it was loaded. "
                "Resume only from checkpoints this version wrote, or train into a new --output-dir "
                "(a checkpoint's weights load as --model)"
            )
    return (good.name if good is not None else None), None


def _gone(trainer: Persistent, good: Path | None, set_aside: list[str]) -> str | None:
    """Why resuming would silently redo steps whose checkpoint was deleted, or None."""
    out, root = trainer.output_dir, trainer.checkpoint_root
    last = _last_checkpoint(out)
    resumed_at = checkpoint_step(good) if good is not None else 0
    if last is not None and last > resumed_at:
        name = checkpoint.step_dir(root, last).name
        corrupt_name = f"{checkpoint.CORRUPT_PREFIX}{last:06d}"  # set aside, and said so: not gone
        if not any(n.split(".")[0] == corrupt_name for n in set_aside):
            return (
                f"--resume: {name}, the newest checkpoint this run wrote, is gone from {root}; resuming "
                f"would redo steps {resumed_at}..{last - 1}. Restore it, or train into a new --output-dir"
            )
    logged = read_jsonl(out / METRICS_FILE)
    if last is None and not root.is_dir() and logged:
        return (
            f"--resume: {root} is missing but {METRICS_FILE} records {len(logged)} steps; resuming would "
            "train from step 0 over them. Restore it, or train into a new --output-dir"
        )
    return None


def _last_checkpoint(out: Path) -> int | None:
    path = out / rundir.LAST_CHECKPOINT_FILE
    if not path.is_file():
        return None
    try:
        step = json.loads(path.read_text()).get("step")
    except (ValueError, AttributeError):
        return None  # unreadable: the checkpoints themselves decide
    return step if type(step) is int else None


def checkpoint_step(folder: Path) -> int:
    return int(folder.name[len(checkpoint.PREFIX) :])
