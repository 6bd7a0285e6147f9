"""A built asset folder, vouched for before use and replaced whole when it is not.

A folder is intact when every file its `asset.json` lists is there at its recorded size
(`asset.json` is written last, into the temporary folder, before the folder is published);
a folder built before `asset.json` existed is intact when the files its asset needs are there
and not empty. Anything else (weights or config removed, a killed build's leftovers, a stray
empty folder) is rebuilt: under a lock file beside it (two ranks building at once: the second
waits and finds the first's folder), into a temporary folder beside it, then swapped in. A
folder that cannot be rebuilt is refused in one line naming it and what is missing.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

RECORD = "asset.json"
# what every HF folder built here holds; an asset may need more (`needs`)
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class AssetUnavailable(RuntimeError):
    """An asset could not be fetched or built; the message says what to do instead."""


def missing(path: Path, needs: tuple[str, ...] = MODEL_FILES) -> list[str]:
    """What `path` lacks to be used: [] when intact, else each absent or cut file (or the folder)."""
    if not path.is_dir():
        return ["the folder itself"]
    record = path / RECORD
    if not record.is_file():  # built before the record: the needed files, none empty
        return [f for f in needs if not (path / f).is_file() or (path / f).stat().st_size == 0]
    try:
        files = json.loads(record.read_text())["files"]
        sizes = {str(k): int(v) for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return [f"{RECORD} (unreadable)"]
    out = [f for f in needs if f not in sizes]
    for name, size in sorted(sizes.items()):
        file = path / name
        if not file.is_file():
            out.append(name)
        elif file.stat().st_size != size:
            out.append(f"{name} (cut: {file.stat().st_size} of {size} bytes)")
    return out


def ensure(path: Path, build: Callable[[Path], Path | None], needs: tuple[str, ...] = MODEL_FILES) -> Path:
    """`path`, built by `build(tmp)` first unless it is intact; rebuilt whole if it is damaged.

    `build` fills the empty folder `tmp` beside `path` (or returns a folder inside `tmp` that it
    filled). An `AssetUnavailable` or `OSError` of a rebuild names `path` and what it lacked.
    """
    if not missing(path, needs):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        lacking = missing(path, needs)
        if not lacking:  # another process built it while this one waited
            return path
        damaged = f"{path} is incomplete (missing {', '.join(lacking)})" if path.exists() else None
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            built = build(tmp) or tmp
            _record(built, needs)
            _swap(built, path)
        except (AssetUnavailable, OSError) as exc:
            if damaged is None:
                raise
            said = " ".join(str(exc).split())
            raise AssetUnavailable(f"{damaged}; rebuilding it failed: {said}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _record(built: Path, needs: tuple[str, ...]) -> None:
    lacking = [f for f in needs if not (built / f).is_file()]
    if lacking:  # a build that forgot a file would publish a folder every later run rebuilds
        raise AssetUnavailable(f"building {built.name} wrote no {', '.join(lacking)}")
    files = {
        p.relative_to(built).as_posix(): p.stat().st_size for p in sorted(built.rglob("*")) if p.is_file()
    }
    (built / RECORD).write_text(json.dumps({"files": files}, indent=1))


def _swap(built: Path, path: Path) -> None:
    # a rename onto a folder that holds anything fails (ENOTEMPTY): the damaged one is moved
    # aside first, and removed once the new one is in place
    aside = None
    if path.exists() or path.is_symlink():
        aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.damaged.", dir=path.parent))
        os.replace(path, aside / path.name)
    os.replace(built, path)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `.NAME.lock` beside `path`, held by one process (rank) at a time."""
    with open(path.parent / f".{path.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
