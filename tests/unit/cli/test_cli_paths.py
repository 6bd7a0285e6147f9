"""The launch scripts' plug-ins: a `MODULE:NAME` next to where the user runs them is importable."""

from __future__ import annotations

import sys

from interlens_mcore.cli.args import parse
from interlens_mcore.plugins import load_object


def test_parsing_the_options_makes_the_working_directory_importable(tmp_path, monkeypatch):
    (tmp_path / "layout_plugin_here.py").write_text("def make_tasks():\n    return 'mine'\n")
    monkeypatch.chdir(tmp_path)
    # as under `torchrun launch/train_grpo.py`: the script's folder is on the path, not the cwd
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "layout_plugin_here", raising=False)
    parse(["--steps", "1"], description="test")
    assert sys.path[0] == str(tmp_path)
    assert load_object("layout_plugin_here:make_tasks", what="--task")() == "mine"
    parse(["--steps", "1"], description="test")
    assert sys.path.count(str(tmp_path)) == 1  # once, however often the options are parsed
    sys.modules.pop("layout_plugin_here", None)
