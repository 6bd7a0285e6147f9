"""A DeepSpeed start next to a stale torch extension build lock: it starts, and names the file."""

from __future__ import annotations

from support.launch import SMALL, torchrun


def test_a_stale_shm_build_lock_does_not_hang_a_deepspeed_start(tmp_path):
    extensions = tmp_path / "torch_extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()  # what a start killed during DeepSpeed's JIT build of its shm op leaves
    out = tmp_path / "run"
    args = ["--backend", "deepspeed", "--zero-stage", "1", "--output-dir", str(out), "--steps", "1", *SMALL]
    # before: the start waited on the lock forever, printing nothing; the deadline proves it does not
    res = torchrun(*args, nproc=1, timeout=400, TORCH_EXTENSIONS_DIR=str(extensions))
    assert res.returncode == 0, res.stderr[-3000:]
    said = [line for line in res.stderr.splitlines() if str(lock) in line]
    assert len(said) == 1 and "delete" in said[0], res.stderr[-3000:]
    # nothing was built: the folder holds only the stale lock
    assert sorted(extensions.rglob("*")) == [lock.parent, lock]
