"""No code runs from a checkpoint: a pickle payload in the trainer's state, in DCP's metadata or
in a torch.save file is refused before anything loads it, and nothing of it runs.

The payload is a pickle whose unpickling would call `os.system("touch FILE")`: the tests assert
that FILE was never created.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from support.launch import SMALL, metrics, python, torchrun

from interlens_mcore.distributed import safe_load
from trainers import checkpoint, own_state


class Payload:
    """Unpickling this runs `touch <path>`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_torch_file_carrying_a_payload_is_refused_unread(tmp_path):
    touched = tmp_path / "touched"
    torch.save({"step": 2, "rng": Payload(touched)}, tmp_path / "trainer-rank00000.pt")
    with pytest.raises(
        safe_load.UnsafeCheckpoint, match=r"trainer-rank00000.pt is a pickle that would call posix.system"
    ):
        safe_load.check_checkpoint(tmp_path)
    assert not touched.exists()


def test_a_raw_pickle_is_refused_unread(tmp_path):
    touched = tmp_path / "touched"
    (tmp_path / "state.bin").write_bytes(pickle.dumps(Payload(touched)))
    with pytest.raises(safe_load.UnsafeCheckpoint, match=r"state.bin is a raw pickle"):
        safe_load.check_checkpoint(tmp_path)
    assert not touched.exists()


def test_a_safetensors_file_whose_header_length_looks_like_a_pickle_is_data(tmp_path):
    from safetensors.torch import save_file

    # a tensor name of 580 characters makes the JSON header 640 bytes long: 0x280, so the file
    # opens with the bytes 80 02, the start of a pickle of protocol 2
    save_file({"a" * 580: torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    assert (tmp_path / "model.safetensors").read_bytes()[:2] == bytes([0x80, 0x02])
    safe_load.check_checkpoint(tmp_path)


def test_dcp_metadata_carrying_a_payload_is_refused_unread(tmp_path):
    touched = tmp_path / "touched"
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / ".metadata").write_bytes(pickle.dumps(Payload(touched)))
    with pytest.raises(
        safe_load.UnsafeCheckpoint, match=r"weights/.metadata would call posix.system when read"
    ):
        safe_load.check_checkpoint(tmp_path)
    with pytest.raises(safe_load.UnsafeCheckpoint, match="would call posix.system"):
        safe_load.dcp_metadata(weights)  # the reader every DCP load here goes through
    assert not touched.exists()


def test_trainer_state_is_json_and_safetensors(tmp_path):
    own_state.TrainerState.capture(step=3, skipped_steps=1).write(tmp_path, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "trainer-rank00000.json",
        "trainer-rank00000.safetensors",
    ]
    assert json.loads((tmp_path / "trainer-rank00000.json").read_text())["step"] == 3
    safe_load.check_checkpoint(tmp_path)  # nothing in it is a pickle
    assert own_state.read(tmp_path, 0).skipped_steps == 1


def _plant_payload(ckpt: Path, touched: Path) -> None:
    """What a shared checkpoint could hold: the trainer's state as a pickle, and a manifest to match."""
    for name in ("trainer-rank00000.json", "trainer-rank00000.safetensors"):
        (ckpt / name).unlink()
    torch.save({"step": 2, "rng": Payload(touched), "skipped_steps": 0}, ckpt / "trainer-rank00000.pt")
    checkpoint.write_manifest(ckpt)
    assert checkpoint.verify(ckpt) is None  # the manifest vouches for it: only the check stops it


def test_resume_refuses_a_checkpoint_carrying_a_payload(tmp_path):
    out, touched = tmp_path / "run", tmp_path / "touched"
    res = torchrun("--output-dir", str(out), "--steps", "2", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    ckpt = out / "checkpoints" / "step-000002"
    _plant_payload(ckpt, touched)

    res = torchrun("--output-dir", str(out), "--steps", "4", *SMALL, "--resume")
    assert res.returncode != 0
    said = [line for line in res.stderr.splitlines() if line.startswith("train_grpo.py:")]
    assert said == [
        f"train_grpo.py: error: checkpoint {ckpt} is refused: trainer-rank00000.pt is a pickle that "
        "would call posix.system when loaded; nothing of it was loaded. Resume only from checkpoints "
        "this version wrote, or train into a new --output-dir (a checkpoint's weights load as --model)"
    ], res.stderr[-3000:]
    assert not touched.exists()
    assert "trainers/" not in res.stderr  # no traceback of the workers (torchrun's own follows)
    assert [r["step"] for r in metrics(out)] == [0, 1] and ckpt.is_dir()  # nothing ran, nothing moved


def test_a_megatron_checkpoint_as_model_carrying_a_payload_is_refused(tmp_path):
    out, touched = tmp_path / "run", tmp_path / "touched"
    res = torchrun("--output-dir", str(out), "--steps", "2", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    model = tmp_path / "model"
    shutil.copytree(out / "checkpoints" / "step-000002", model)
    (model / "weights" / ".metadata").write_bytes(pickle.dumps(Payload(touched)))

    res = python("--model", str(model), "--output-dir", str(tmp_path / "again"), *SMALL)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"train_grpo.py: error: --model {model}: refused, {model}/weights/.metadata would call "
        "posix.system when read (DCP metadata holds data classes only)"
    ]
    assert not touched.exists() and not (tmp_path / "again").exists()
