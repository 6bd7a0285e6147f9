"""No code runs from a checkpoint: a pickle payload in the trainer's state, in DCP's metadata or
in a torch.save file is refused before anything loads it, and nothing of it runs.

The payload is a pickle whose unpickling would call `os.system("touch FILE")`: the tests assert
that FILE was never created. The fuzz test puts it, in every pickle protocol (0 to 5) and as a
torch.save archive, in place of each file of a real checkpoint of each backend layout (megatron
DCP, DeepSpeed ZeRO-1, ZeRO-3, LoRA), one 2-step torchrun each, shared by the module's tests.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
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


@pytest.mark.parametrize("protocol", range(6))
def test_a_raw_pickle_of_any_protocol_is_refused_unread(tmp_path, protocol):
    touched = tmp_path / "touched"
    (tmp_path / "state.bin").write_bytes(pickle.dumps(Payload(touched), protocol=protocol))
    with pytest.raises(safe_load.UnsafeCheckpoint) as caught:
        safe_load.check_checkpoint(tmp_path)
    assert str(caught.value) == "state.bin is a pickle that would call posix.system when loaded"
    assert not touched.exists()


def test_a_global_named_through_the_memo_is_found():
    # protocol 4 names a global by the two strings on the stack; here both come from the memo,
    # pushed long before STACK_GLOBAL (a scan that reads only the opcode's neighbours misses it)
    data = pickle.dumps(("os", "system", Payload(Path("x"))), protocol=4)
    assert safe_load.unsafe_globals(data) == ["posix.system"]
    assert safe_load.unsafe_globals(pickle.dumps({"a": [1, 2.0, "s"]}, protocol=0)) == []


def test_a_pickle_after_a_valid_one_is_scanned_too(tmp_path):
    # torch's legacy format is several pickles in a row, and its loader unpickles each
    magic = pickle.dumps(119547037146038801333356, protocol=0)  # the legacy format's first pickle
    data = magic + pickle.dumps(Payload(tmp_path), protocol=1)
    assert safe_load.unsafe_globals(data) == ["posix.system"]


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
        safe_load.UnsafeCheckpoint, match=r"weights/.metadata is a pickle that would call posix.system"
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


def test_resume_refuses_a_checkpoint_carrying_a_payload(tmp_path, tmp_path_factory):
    out, touched = tmp_path / "run", tmp_path / "touched"
    shutil.copytree(_run("megatron", tmp_path_factory), out)
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


def test_a_megatron_checkpoint_as_model_carrying_a_payload_is_refused(tmp_path, tmp_path_factory):
    out, touched = tmp_path / "run", tmp_path / "touched"
    shutil.copytree(_run("megatron", tmp_path_factory), out)
    model = tmp_path / "model"
    shutil.copytree(out / "checkpoints" / "step-000002", model)
    (model / "weights" / ".metadata").write_bytes(pickle.dumps(Payload(touched)))

    res = python("--model", str(model), "--output-dir", str(tmp_path / "again"), *SMALL)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"train_grpo.py: error: --model {model}: refused, {model}/weights/.metadata is a pickle that "
        "would call posix.system when loaded"
    ]
    assert not touched.exists() and not (tmp_path / "again").exists()


BACKENDS = {
    "megatron": [],
    "deepspeed-zero1": ["--backend", "deepspeed", "--zero-stage", "1"],
    "deepspeed-zero3": ["--backend", "deepspeed", "--zero-stage", "3"],
    "lora": ["--backend", "deepspeed", "--zero-stage", "3", "--lora_r", "8", "--lora-target-modules",
        "q_proj"],
}
_RUNS: dict[str, Path] = {}


def _run(backend: str, tmp_path_factory) -> Path:
    """One finished 2-step run of `backend`, made once for the module; its checkpoint at step 2."""
    if backend not in _RUNS:
        out = tmp_path_factory.mktemp(backend) / "run"
        args = ["--output-dir", str(out), "--steps", "2", "--eval-every", "0", *BACKENDS[backend]]
        res = torchrun(*args, *SMALL)
        assert res.returncode == 0, res.stderr[-3000:]
        _RUNS[backend] = out
    return _RUNS[backend]


def _pickled(touched: Path, protocol: int | str) -> bytes:
    if protocol == "torch.save":
        buf = io.BytesIO()
        torch.save({"state": Payload(touched)}, buf)
        return buf.getvalue()
    return pickle.dumps({"module": Payload(touched)}, protocol=protocol)


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5, "torch.save"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_file_of_every_backend_carrying_a_payload_is_refused(
    tmp_path, tmp_path_factory, backend, protocol
):
    ckpt = _run(backend, tmp_path_factory) / "checkpoints" / "step-000002"
    kinds = sorted(
        p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json"
    )
    assert any(k.startswith("deepspeed/") or k.startswith("weights/") for k in kinds)
    touched, copy = tmp_path / "touched", tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    for kind in kinds:  # one file at a time carries the payload, the others are the run's own
        kept = (copy / kind).read_bytes()
        (copy / kind).write_bytes(_pickled(touched, protocol))
        with pytest.raises(safe_load.UnsafeCheckpoint) as caught:
            safe_load.check_checkpoint(copy)
        said = str(caught.value)
        # a DCP data file is named with the entry DCP would read from it
        entry = " entry '.*'" if kind.endswith(".distcp") else ""
        want = f"{re.escape(kind)}{entry} is a pickle that would call posix.system when loaded"
        assert re.fullmatch(want, said), said
        if kind.endswith(".pt"):  # DeepSpeed's loader here: weights_only, so it would refuse too
            with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
                safe_load.weights_only_load(copy / kind)
        assert not touched.exists(), kind
        (copy / kind).write_bytes(kept)
    safe_load.check_checkpoint(copy)  # each file restored: the run's own checkpoint is data


def test_resume_refuses_a_deepspeed_state_of_protocol_0_carrying_a_payload(tmp_path, tmp_path_factory):
    """The file named in issue 54, end to end (torchrun: the refusal is the resume's, on every rank)."""
    out, touched = tmp_path / "run", tmp_path / "touched"
    shutil.copytree(_run("deepspeed-zero1", tmp_path_factory), out)
    ckpt = out / "checkpoints" / "step-000002"
    states = ckpt / "deepspeed" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    states.write_bytes(pickle.dumps(Payload(touched), protocol=0))
    checkpoint.write_manifest(ckpt)

    args = ["--output-dir", str(out), "--steps", "4", "--eval-every", "0", *BACKENDS["deepspeed-zero1"]]
    res = torchrun(*args, *SMALL, "--resume")
    assert res.returncode != 0
    said = [line for line in res.stderr.splitlines() if line.startswith("train_grpo.py:")]
    assert said == [
        f"train_grpo.py: error: checkpoint {ckpt} is refused: "
        "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt is a pickle that "
        "would call posix.system when loaded; nothing of it was loaded. Resume only from checkpoints "
        "this version wrote, or train into a new --output-dir (a checkpoint's weights load as --model)"
    ], res.stderr[-3000:]
    assert not touched.exists() and ckpt.is_dir()
