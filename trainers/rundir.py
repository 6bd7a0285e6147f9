"""A run's output folder: who may write into it, and what `run.json` says about the run.

The same rules hold for the command line and for a trainer built in Python: a folder holds
nothing, or one run. Writing into a folder that holds another run needs `resume`, and resuming
with options that change the run is refused, naming each changed option with its old and new
value; nothing already written is ever truncated. Options that only say how long, where, or how
often to write (`RESUMABLE`) may change between a run and its resumption: `--resume --steps N`
with a larger N extends a finished run.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

RUN_FILE, LOCK_FILE = "run.json", ".lock"
# the newest checkpoint the run published: a resumption that finds it gone refuses to start over
LAST_CHECKPOINT_FILE = "last_checkpoint.json"
RESUMABLE = {
    "steps",
    "sft_steps",  # like steps: a resumed warm-up may run longer (once GRPO began it is never redone)
    "output_dir",
    "save_every",
    "save_total_limit",
    "report_to",
    "log_completions_every",
    "log_completions",
    "eval_every",
    "eval_size",  # how many held-out rows an evaluation plays (--eval-only of a run may take more)
    "resume",
    "export_hf",
    "save_on_signal",
    "tp",  # checkpoints are sharded and reshard: a run saved at TP=2 resumes at TP=1
    "pp",  # and across pipeline stages: a run saved at PP=2 resumes at PP=1
    # what a step does with failed samples: a run that --max-failed-fraction ended may resume
    # with a higher limit, or with --on-sample-error raise to see the first failure
    "max_failed_fraction",
    "on_sample_error",
    "overlap",  # how a rollout's rounds are scheduled, not what they produce
}


class RunDirError(ValueError):
    """The output folder cannot take this run (the message names --output-dir and the reason)."""


def fresh_name(task: str, root: Path = Path("runs")) -> Path:
    """`runs/<task>-<timestamp>`, with a suffix if that already exists."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in task)
    out, k = root / f"{safe}-{stamp}", 1
    while out.exists():
        out, k = root / f"{safe}-{stamp}.{k}", k + 1
    return out


def identity(run: Mapping[str, object]) -> dict[str, object]:
    """The options that define a run (resuming must not change them)."""
    return {k: v for k, v in run.items() if k not in RESUMABLE}


def option_defaults() -> dict[str, object]:
    """Every trainer, backend, rollout and loss option's default, by name, as run.json holds them."""
    import dataclasses

    from interlens_mcore.grpo.loss.config import LossConfig
    from interlens_mcore.rollout.rollouter import RolloutConfig

    from .config import BackendConfig, TrainerConfig

    out: dict[str, object] = {}
    for cls in (TrainerConfig, BackendConfig, RolloutConfig, LossConfig):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
    return json.loads(json.dumps(out, default=str))  # as json gives them back (tuples as lists)


def check(out: Path, run: Mapping[str, object], *, resume: bool) -> None:
    """Raise RunDirError unless `out` may take `run` (reads only)."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--output-dir {out}: exists and is not a folder")
    info = out / RUN_FILE
    if not info.is_file():
        if out.is_dir() and any(p.name != LOCK_FILE for p in out.iterdir()):
            raise RunDirError(f"--output-dir {out}: holds files that are not a run of this trainer")
        return
    if not resume:
        raise RunDirError(
            f"--output-dir {out}: holds another run; pass --resume to continue it "
            "(or --resume with a larger --steps to extend it), or choose an empty folder"
        )
    old, new = identity(json.loads(info.read_text())), identity(run)
    # an option newer than the run's run.json, left at its default, is what the run did
    defaults = option_defaults()
    old.update({k: v for k, v in new.items() if k not in old and k in defaults and defaults[k] == v})
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if changed:
        said = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise RunDirError(
            f"--output-dir {out}: --resume with different options: {', '.join(changed)} ({said}); "
            "start a new run in another folder to change them"
        )


def lock(out: Path, run: Mapping[str, object], *, resume: bool) -> TextIO:
    """Take `.lock` for this process's lifetime, then `check`; returns the lock handle.

    Nothing in the folder is read or removed before the lock is held: a run whose launcher was
    killed may leave workers running (torchrun starts them in their own sessions), and a second
    run must not touch what they write. The kernel drops the lock when its holder dies, so a
    killed run never blocks its resumption. A refusal leaves the folder as it found it.
    """
    import fcntl

    if out.exists() and not out.is_dir():
        raise RunDirError(f"--output-dir {out}: exists and is not a folder")
    created = [p for p in (out, *out.parents) if not p.exists()]
    lock_created = not (out / LOCK_FILE).exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        handle = (out / LOCK_FILE).open("a")
    except OSError as exc:
        _remove(created)
        raise RunDirError(f"--output-dir {out}: cannot create it ({exc.strerror or exc})") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RunDirError(
            f"--output-dir {out}: another process is still writing to it (.lock is held)"
        ) from None
    try:
        check(out, run, resume=resume)
    except RunDirError:
        if lock_created:
            (out / LOCK_FILE).unlink()
        handle.close()
        _remove(created)
        raise
    return handle


def _remove(created: list[Path]) -> None:
    # the folders this process made, deepest first; one another process filled since stays
    for p in created:
        try:
            p.rmdir()
        except OSError:
            return


def write_json_atomic(path: Path, data: Mapping[str, object]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    tmp.replace(path)
