"""Checkpoint manifests: `verify` finds a flipped byte, a cut file, a lost file; resume skips them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from support.launch import SMALL, metrics, torchrun

from interlens_mcore import distributed
from trainers import checkpoint


def _write(folder: Path) -> None:
    # a torch file, and a nested folder as DeepSpeed writes (deepspeed/mp_rank_00_model_states.pt)
    torch.save({"w": torch.arange(64, dtype=torch.float32)}, folder / "model-tp00.pt")
    (folder / "deepspeed" / "zero").mkdir(parents=True)
    (folder / "deepspeed" / "zero" / "optim.bin").write_bytes(bytes(range(256)) * 4)
    (folder / "deepspeed" / "latest").write_text("deepspeed")


def _save(root: Path, step: int) -> Path:
    # one process, no process group: save's barriers and rank checks must be no-ops
    assert not distributed.is_initialized()
    return checkpoint.save(root, step, _write, meta={"run": {}})


def _flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    folder = _save(tmp_path, 2)
    manifest = json.loads((folder / "manifest.json").read_text())["files"]
    assert sorted(manifest) == ["deepspeed/latest", "deepspeed/zero/optim.bin", "model-tp00.pt"]
    assert manifest["deepspeed/zero/optim.bin"]["bytes"] == 1024
    assert manifest["deepspeed/latest"] == {"bytes": 9, "sha256": hashlib.sha256(b"deepspeed").hexdigest()}
    assert checkpoint.verify(folder) is None


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda f: _flip_byte(f / "model-tp00.pt"), "model-tp00.pt: sha256 mismatch"),
        (
            lambda f: _flip_byte(f / "deepspeed/zero/optim.bin", 7),
            "deepspeed/zero/optim.bin: sha256 mismatch",
        ),
        (
            lambda f: (f / "deepspeed/zero/optim.bin").write_bytes(bytes(1000)),
            "deepspeed/zero/optim.bin: truncated (1000 of 1024 bytes)",
        ),
        (
            lambda f: (f / "deepspeed/latest").write_text("deepspeed!"),
            "deepspeed/latest: size mismatch (10 bytes, expected 9)",
        ),
        (lambda f: (f / "model-tp00.pt").unlink(), "model-tp00.pt: missing"),
        (lambda f: (f / "manifest.json").unlink(), "manifest.json: missing"),
        (lambda f: (f / "meta.json").unlink(), "meta.json: missing"),
    ],
)
def test_verify_names_the_damaged_file(tmp_path, damage, reason):
    folder = _save(tmp_path, 2)
    damage(folder)
    assert checkpoint.verify(folder) == reason


def test_verify_reports_an_unreadable_manifest(tmp_path):
    folder = _save(tmp_path, 2)
    _flip_byte(folder / "manifest.json", 0)  # '{' becomes a byte that is not JSON (nor UTF-8)
    assert checkpoint.verify(folder).startswith("manifest.json: unreadable JSON")
    folder = _save(tmp_path, 4)
    (folder / "meta.json").write_text('{"step": 4')
    assert checkpoint.verify(folder).startswith("meta.json: unreadable JSON")


def test_newest_intact_sets_corrupt_ones_aside_and_retention_ignores_them(tmp_path):
    _save(tmp_path, 2)
    _flip_byte(_save(tmp_path, 4) / "model-tp00.pt")
    good, bad = checkpoint.newest_intact(tmp_path)
    assert good == tmp_path / "step-000002"
    assert bad == [("step-000004", "model-tp00.pt: sha256 mismatch", "corrupt-step-000004")]
    # the same step going bad again (a later run) keeps both copies
    _flip_byte(_save(tmp_path, 4) / "model-tp00.pt")
    good, bad = checkpoint.newest_intact(tmp_path)
    assert good.name == "step-000002" and bad[0][2] == "corrupt-step-000004.1"
    # keep=2 removes step-000002 once steps 4 and 6 exist, never the folders set aside
    _save(tmp_path, 4)
    _save(tmp_path, 6)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["corrupt-step-000004", "corrupt-step-000004.1", "step-000004", "step-000006"]
    assert checkpoint.corrupt(tmp_path) == ["corrupt-step-000004", "corrupt-step-000004.1"]
    assert checkpoint.newest_intact(tmp_path) == (tmp_path / "step-000006", [])


@pytest.mark.slow  # not a first path: the slow stage (README, Set-up)
def test_resume_skips_a_corrupt_checkpoint(tmp_path):
    # --resume keeps --steps (a run's options are fixed), so the finished run's newest
    # checkpoint goes bad and the resume redoes steps 4 and 5 from the one before it
    out = tmp_path / "run"
    res = torchrun("--output-dir", str(out), "--steps", "6", *SMALL)  # SMALL saves every 2 steps
    assert res.returncode == 0, res.stderr[-3000:]
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000004", "step-000006"]
    _flip_byte(ckpts / "step-000006" / "weights" / "__0_0.distcp")  # rank 0's shard of the weights

    res = torchrun("--output-dir", str(out), "--steps", "6", *SMALL, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        "checkpoint step-000006 is corrupt (weights/__0_0.distcp: sha256 mismatch), kept as "
        "corrupt-step-000006; resuming from step-000004"
    ) in res.stderr
    assert "resuming at step 4 of 6" in res.stderr
    # every step logged exactly once: the two after the good checkpoint were redone
    assert [r["step"] for r in metrics(out)] == list(range(6))
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["corrupt-step-000006", "step-000004", "step-000006"]
    assert checkpoint.verify(ckpts / "step-000006") is None


@pytest.mark.slow  # not a first path: the slow stage (README, Set-up)
def test_resume_refuses_when_every_checkpoint_is_corrupt(tmp_path):
    out = tmp_path / "run"
    res = torchrun("--output-dir", str(out), "--steps", "2", *SMALL)
    assert res.returncode == 0, res.stderr[-3000:]
    (out / "checkpoints" / "step-000002" / "weights" / "__1_0.distcp").unlink()

    for attempt in range(2):  # the second finds only the folder the first set aside
        # the real torchrun: the test reads its failure summary
        res = torchrun("--output-dir", str(out), "--steps", "2", *SMALL, "--resume", warm=False)
        # the workers print one line and exit 2 (torchrun adds its own failure summary)
        assert res.returncode != 0 and "exitcode  : 2" in res.stderr and "trainers/" not in res.stderr
        assert "train_grpo.py: error: no intact checkpoint" in res.stderr
        if attempt == 0:
            assert "checkpoint step-000002 is corrupt (weights/__1_0.distcp: missing)" in res.stderr
        assert (
            f"train_grpo.py: error: no intact checkpoint in {out / 'checkpoints'} to resume from; "
            "set aside as corrupt: corrupt-step-000002. Delete them to train this run again from "
            "step 0 with --resume, or train into a new --output-dir"
        ) in res.stderr.splitlines()
    # nothing was trained from step 0 over the old run's log
    assert [r["step"] for r in metrics(out)] == [0, 1]


def test_verify_names_a_file_the_manifest_does_not_list(tmp_path):
    folder = _save(tmp_path, 2)
    (folder / "deepspeed" / "extra.pt").write_bytes(b"not vouched for")
    assert checkpoint.verify(folder) == "deepspeed/extra.pt: not in manifest.json"
    # an emptied manifest vouches for nothing
    (folder / "manifest.json").write_text(json.dumps({"files": {}}))
    assert checkpoint.verify(folder) == "deepspeed/extra.pt: not in manifest.json (and 3 more)"


def test_verify_refuses_a_manifest_entry_outside_the_folder(tmp_path):
    folder = _save(tmp_path, 2)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["../elsewhere"] = {"bytes": 1, "sha256": "0" * 64}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.verify(folder) == "manifest.json: entry ../elsewhere is outside the checkpoint"


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.slow  # not a first path: the slow stage (README, Set-up)
def test_resume_falls_back_past_an_unlisted_and_an_unloadable_checkpoint(tmp_path):
    out = tmp_path / "run"
    keep = ["--save-total-limit", "3"]  # steps 2, 4 and 6 are kept
    res = torchrun("--output-dir", str(out), "--steps", "6", *SMALL, *keep)
    assert res.returncode == 0, res.stderr[-3000:]
    ckpts = out / "checkpoints"
    # step 6: its manifest emptied and a weights file cut short, so the manifest vouches for nothing
    (ckpts / "step-000006" / "manifest.json").write_text(json.dumps({"files": {}}))
    _cut(ckpts / "step-000006" / "weights" / "__0_0.distcp")
    # step 4: a weights file cut short under a manifest rewritten to match: only loading finds it
    _cut(ckpts / "step-000004" / "weights" / "__1_0.distcp")
    checkpoint.write_manifest(ckpts / "step-000004")
    assert checkpoint.verify(ckpts / "step-000004") is None

    res = torchrun("--output-dir", str(out), "--steps", "6", *SMALL, *keep, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    said = res.stderr.splitlines()
    corrupt = [line for line in said if line.startswith("checkpoint step-000006 is corrupt (")]
    assert len(corrupt) == 1 and "not in manifest.json" in corrupt[0], res.stderr[-3000:]
    assert corrupt[0].endswith("kept as corrupt-step-000006; resuming from step-000004")
    unloadable = [line for line in said if line.startswith("checkpoint step-000004 does not load (rank ")]
    assert len(unloadable) == 1 and unloadable[0].endswith("kept as corrupt-step-000004"), res.stderr[-3000:]
    assert "resuming at step 2 of 6" in res.stderr
    assert [r["step"] for r in metrics(out)] == list(range(6))
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == [
        "corrupt-step-000004",
        "corrupt-step-000006",
        "step-000002",
        "step-000004",
        "step-000006",
    ]
