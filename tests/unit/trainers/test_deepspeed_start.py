"""What a DeepSpeed start says when it waits: a real torch FileBaton held by a stale lock file."""

from __future__ import annotations

import io
import threading
import time

from torch.utils.file_baton import FileBaton

from trainers.backends.deepspeed import build_locks, said_if_slow


def test_a_wait_on_a_stale_build_lock_names_the_file(tmp_path):
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()  # what a build killed midway leaves
    out = io.StringIO()

    def unlock_once_said() -> None:  # the user, who reads the line and deletes the file
        deadline = time.monotonic() + 60
        while "lock" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        lock.unlink()

    helper = threading.Thread(target=unlock_once_said, daemon=True)
    helper.start()
    with said_if_slow("deepspeed.initialize", after_s=0.2, out=out):
        FileBaton(str(lock), wait_seconds=0.05).wait()  # what cpp_extension does while another build runs
    helper.join(timeout=60)
    said = out.getvalue().splitlines()
    assert len(said) == 1 and said[0].startswith("deepspeed.initialize: still waiting after 0.2 s")
    assert f"on the torch extension build lock {lock}:" in said[0] and "delete it" in said[0]


def test_a_start_that_ends_in_time_says_nothing():
    out = io.StringIO()
    with said_if_slow("deepspeed.initialize", after_s=30, out=out):
        pass
    assert out.getvalue() == ""


def test_a_slow_wait_elsewhere_names_its_line():
    out = io.StringIO()
    with said_if_slow("deepspeed.initialize", after_s=0.1, out=out):
        deadline = time.monotonic() + 60
        while not out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
    assert "still waiting after 0.1 s, at " in out.getvalue() and __file__ in out.getvalue()


def test_build_locks_under_the_extensions_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "lock").touch()
    (tmp_path / "built_op").mkdir()
    (tmp_path / "built_op" / "built_op.so").touch()
    assert build_locks() == [tmp_path / "deepspeed_shm_comm" / "lock"]
