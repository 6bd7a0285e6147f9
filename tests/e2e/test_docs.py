"""Every python block of docs/guide.md runs as written, each in a fresh process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.launch import env

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"


def _blocks() -> dict[str, str]:
    """{section heading: its python block}."""
    text = GUIDE.read_text()
    out = {}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        heading, _, body = section.partition("\n")
        code = re.findall(r"```python\n(.*?)```", body, flags=re.S)
        if code:
            out[heading.strip()] = code[0]
    return out


BLOCKS = _blocks()


def test_guide_has_the_five_recipes():
    recipes = ["An environment", "A scheduler", "A reward function", "A lineup", "A custom trainer"]
    assert list(BLOCKS) == [*recipes, "Adding a backend"]
    # the issue asks for snippets of under 30 lines (the backend's own length is checked by
    # tests/unit/trainers/test_toy_backend.py, which trains it)
    assert all(len(BLOCKS[recipe].splitlines()) < 30 for recipe in recipes)


@pytest.mark.parametrize("heading", list(BLOCKS))
def test_snippet_runs(heading, tiny_path):
    # tiny_path builds the tiny model where load_tiny() looks for it when INTERLENS_ASSETS is set
    extra = {"INTERLENS_ASSETS": str(tiny_path.parent)} if tiny_path.name == "tiny-qwen2" else {}
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKS[heading]],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=env(**extra),
    )
    assert proc.returncode == 0, f"{heading}:\n{proc.stderr[-3000:]}"
