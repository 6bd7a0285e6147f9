"""The seeds benchmark: its rule, and two seeds of a real 2-step job under torchrun.

The run test starts its own torchrun runs (the benchmark's whole job is to launch them and read
what they wrote), so it cannot share a finished run of another test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_seeds as bs  # noqa: E402


def test_the_rule_decides_only_with_three_seeds_an_arm():
    base = bs.summarize([0.90, 0.92, 0.88])
    assert base["mean"] == 0.9 and base["min"] == 0.88 and base["max"] == 0.92
    # t(0.975, 2) = 4.303: the half-width is 4.303 * 0.02 / sqrt(3)
    assert base["ci95"] == pytest.approx([0.9 - 0.0497, 0.9 + 0.0497], abs=1e-4)
    assert bs.decide(base, bs.summarize([0.89, 0.91, 0.90]))["verdict"] == "ships"
    assert bs.decide(base, bs.summarize([0.95, 0.97, 0.99]))["verdict"] == "ships"  # above: better
    low = bs.decide(base, bs.summarize([0.80, 0.90, 0.85]))
    assert low["verdict"] == "hold back" and low["delta_mean"] == pytest.approx(-0.05)
    assert bs.decide(bs.summarize([0.9, 0.9]), bs.summarize([0.1, 0.1]))["verdict"] == "undecided"
    assert bs.t975(25) == bs.T975[20] and bs.summarize([]) == {"n": 0}


def test_bad_options_are_refused_naming_them(capsys):
    for argv, says in (
        (["--seeds", "0"], "--seeds must be >= 1, got 0"),
        (["--vs", " "], "--vs needs the options"),
        (["--compare", "main", "--vs", "--beta 0.04"], "not allowed with argument"),
    ):
        with pytest.raises(SystemExit):
            bs.main(argv)
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--compare no-such-rev: not a commit"):
        bs.main(["--compare", "no-such-rev", "--out-dir", "/tmp/never-written"])


@pytest.mark.slow  # four cold torchrun runs (the benchmark starts torchrun itself, as a user's runs start)
def test_two_seeds_two_arms_of_a_real_job(tmp_path, capsys):
    job = ["--steps", "2", "--eval-every", "1", "--eval-size", "4", "--batch-size", "8"]
    job += ["--num-generations", "4"]
    argv = ["--seeds", "2", "--vs", "--temperature 0.8", "--out-dir", str(tmp_path), "--json", "--", *job]
    rc = bs.main(argv)
    out = capsys.readouterr()
    line = json.loads(out.out.strip().splitlines()[-1])
    assert rc == 0, out.err
    assert line["seeds"] == [0, 1] and list(line["arms"]) == ["this", "vs"]
    # the progress lines, interleaved: seed 0 of each arm before seed 1 of either
    order = [x.split("]")[1].split(":")[0].strip() for x in out.err.splitlines() if ": exit " in x]
    assert order == ["this seed 0", "vs seed 0", "this seed 1", "vs seed 1"]
    for name, arm in line["arms"].items():
        for run in arm["runs"]:
            metrics = tmp_path / f"{name}-seed{run['seed']}" / "run" / "metrics.jsonl"
            evals = [json.loads(r) for r in metrics.read_text().splitlines()]
            rates = [r["eval/success_rate"] for r in evals if "eval/success_rate" in r]
            # what the line reports is what each run wrote
            assert [e["success"] for e in run["evals"]] == rates and run["final"] == rates[-1]
            assert run["steps"] == 2 and run["step_s_median"] > 0 and run["wall_s"] > 0
        assert arm["final"]["n"] == 2 and "sd" in arm["final"]
    assert line["arms"]["vs"]["extra_args"] == ["--temperature", "0.8"]
    assert line["decision"]["verdict"] == "undecided"  # two seeds an arm: the rule needs three
    # the two seeds sampled differently: their rollouts are not the same
    first = [(tmp_path / f"this-seed{s}" / "run" / "completions.jsonl").read_text() for s in (0, 1)]
    assert first[0] != first[1]
