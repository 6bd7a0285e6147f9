"""docs/swift.md runs as written: its plugin file (one changed import) and the rollout using it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from support.launch import env

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "swift.md"


def test_swift_doc_runs(tmp_path, tiny_path):
    plugin, rollout = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[:2]
    assert "from interlens_mcore.compat.swift import MultiTurnScheduler" in plugin
    (tmp_path / "my_plugin.py").write_text(plugin)
    extra = {"INTERLENS_ASSETS": str(tiny_path.parent)} if tiny_path.name == "tiny-qwen2" else {}
    # it runs where the plugin file is, so the package comes from this checkout through the path
    extra["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", rollout],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env(**extra),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")[:4]
    assert len(lines) == 4 and all(1 <= int(line.split()[0]) <= 2 for line in lines)  # at most one hint


def test_swift_doc_lists_every_semantic_difference():
    text = DOC.read_text()
    for topic in (
        "`done`",
        "`check_finished`",
        "`max_turns`",
        "`on_trajectory_start`",
        "step `rollout_logprobs`",
    ):
        assert f"| {topic} |" in text


def test_swift_doc_says_what_loss_scale_each_release_scheduler_needs():
    text = DOC.read_text()
    table = text.split("### `--loss-scale` per scheduler")[1].split("\n## ")[0]
    for name in ("math_tip_trick", "thinking_tips_scheduler", "gym_scheduler", "openenv_scheduler"):
        (row,) = [line for line in table.splitlines() if f"(`{name}`)" in line]
        assert row.count("|") == 5  # scheduler, ms-swift, here, what to pass
