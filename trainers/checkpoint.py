"""Atomic, verifiable checkpoints: every rank writes into a temporary folder, rank 0 renames it.

A folder named `step-NNNNNN` exists only once every rank's files, `manifest.json` and
`meta.json` are in it (a rename within one filesystem is atomic), so a run killed at any
moment never leaves a half-written checkpoint under a `step-` name. Stale temporary folders
are removed.

Atomicity does not protect a checkpoint after it is published (a disk fault, a copy cut short,
a stray edit). `manifest.json` lists every file with its size and sha256; `verify` checks a
folder against it (a file it does not list fails too: the manifest vouches for the whole
folder), and `newest_intact` renames a folder that fails to `corrupt-step-NNNNNN`, kept for
inspection but never chosen again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from interlens_mcore import distributed

PREFIX, TMP_PREFIX, CORRUPT_PREFIX = "step-", ".tmp-step-", "corrupt-step-"
MANIFEST, META = "manifest.json", "meta.json"


class ResumeRefused(ValueError):
    """`--resume` cannot continue the run in this folder as it is (the message says why and what to do)."""


class NoIntactCheckpoint(ResumeRefused):
    """Resuming found checkpoints, all of them corrupt (starting over would be a silent restart)."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:06d}"


def save(root: Path, step: int, write: Callable[[Path], None], *, meta: dict, keep: int = 2) -> Path:
    """Collective: `write(tmp_folder)` on every rank, then publish as `step-NNNNNN`."""
    tmp = root / f"{TMP_PREFIX}{step:06d}"
    if distributed.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    write(tmp)
    distributed.barrier()  # every rank's files are on disk before the folder is published
    final = step_dir(root, step)
    if distributed.rank() == 0:
        write_manifest(tmp)
        (tmp / META).write_text(json.dumps({"step": step, **meta}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        older = sorted(p for p in root.iterdir() if p.name.startswith(PREFIX) and p != final)
        for p in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
    distributed.barrier()
    return final


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    """`manifest.json`: every file under `folder` (nested ones too), its size and sha256."""
    # only the folder's own manifest and meta are left out; a nested file of either name is data
    own = {folder / MANIFEST, folder / META}
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p not in own)
    entries = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files
    }
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1, sort_keys=True))


def verify(folder: Path) -> str | None:
    """None if `folder` matches its manifest, else a one-line reason naming the file."""
    manifest, reason = _load_json(folder / MANIFEST)
    if reason is None:
        _, reason = _load_json(folder / META)
    if reason is not None:
        return reason
    # the manifest itself may be what went bad: a malformed one is a reason, not a crash
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return f"{MANIFEST}: no 'files' table"
    for rel, want in files.items():
        if not (isinstance(want, dict) and isinstance(want.get("bytes"), int) and "sha256" in want):
            return f"{MANIFEST}: malformed entry for {rel}"
        if PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
            return f"{MANIFEST}: entry {rel} is outside the checkpoint"
        path = folder / rel
        if not path.is_file():
            return f"{rel}: missing"
        size = path.stat().st_size
        if size < want["bytes"]:
            return f"{rel}: truncated ({size} of {want['bytes']} bytes)"
        if size != want["bytes"]:
            return f"{rel}: size mismatch ({size} bytes, expected {want['bytes']})"
        if _sha256(path) != want["sha256"]:
            return f"{rel}: sha256 mismatch"
    return _unlisted(folder, set(files))


def _unlisted(folder: Path, listed: set[str]) -> str | None:
    own = {MANIFEST, META}
    found = sorted(
        rel
        for p in folder.rglob("*")
        if p.is_file() and (rel := p.relative_to(folder).as_posix()) not in listed and rel not in own
    )
    if not found:
        return None
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return f"{found[0]}: not in {MANIFEST}{more}"


def _load_json(path: Path) -> tuple[object, str | None]:
    if not path.is_file():
        return None, f"{path.name}: missing"
    try:
        return json.loads(path.read_text()), None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        return None, f"{path.name}: unreadable JSON ({exc})"


def newest_intact(root: Path) -> tuple[Path | None, list[tuple[str, str, str]]]:
    """The newest checkpoint that `verify` passes, and the newer ones that failed.

    Each failed one is renamed `corrupt-step-NNNNNN` and listed as (old name, reason, new
    name); checkpoints older than the one returned are not read. Rank 0 only (it renames).
    """
    if not root.is_dir():
        return None, []
    bad: list[tuple[str, str, str]] = []
    for folder in sorted((p for p in root.iterdir() if p.name.startswith(PREFIX)), reverse=True):
        reason = verify(folder)
        if reason is None:
            return folder, bad
        bad.append((folder.name, reason, set_aside(root, folder)))
    return None, bad


def corrupt(root: Path) -> list[str]:
    """Names of the checkpoints under `root` set aside as corrupt (by this run or an earlier one)."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.name.startswith(CORRUPT_PREFIX))


def _free_name(root: Path, name: str) -> str:
    # the same step can go bad twice (in two runs); keep both
    n, out = 1, name
    while (root / out).exists():
        out, n = f"{name}.{n}", n + 1
    return out


def clean_stale(root: Path) -> None:
    """Remove temporary folders a killed run left behind (rank 0 only; call before a barrier)."""
    if distributed.rank() == 0 and root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


def set_aside(root: Path, folder: Path) -> str:
    """Rename `folder` to `corrupt-step-NNNNNN` (a free name); returns the new name (rank 0 only)."""
    kept = _free_name(root, CORRUPT_PREFIX + folder.name[len(PREFIX) :])
    os.replace(folder, root / kept)
    return kept
