"""Every recipe in launch/configs starts and trains: 2 steps of each YAML under torchrun, with
its own settings but for the batch, the reply length and the evaluation size (SmolLM2-135M on
CPU: about a minute each on an idle 2-core machine, so marked `slow`)."""

from __future__ import annotations

import pytest
from support.launch import ROOT, metrics, torchrun

pytestmark = pytest.mark.slow

RECIPES = sorted((ROOT / "launch" / "configs").glob("*.yaml"))
QUICK = ["--steps", "2", "--batch-size", "8", "--max-new-tokens", "8", "--eval-every", "0"]
QUICK += ["--eval-size", "4", "--save-every", "2"]


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_each_recipe_trains_two_steps(recipe, tmp_path):
    out = tmp_path / "run"
    run = torchrun("--config", str(recipe), *QUICK, "--output-dir", str(out), timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["tokens"] > 0 for r in rows), rows
    assert (out / "checkpoints" / "step-000002").is_dir()
