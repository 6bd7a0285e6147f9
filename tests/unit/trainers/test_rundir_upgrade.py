"""Resuming a run whose run.json predates an option: the option at its default is what the run did."""

from __future__ import annotations

import json

import pytest

from trainers import rundir


def _run(tmp_path, **options):
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    old = {"lr": 0.001, "steps": 3}  # written before --dynamic-sampling existed
    (out / rundir.RUN_FILE).write_text(json.dumps(old))
    rundir.check(out, {"lr": 0.001, "steps": 5, **options}, resume=True)


def test_an_option_newer_than_the_run_at_its_default_resumes(tmp_path):
    _run(tmp_path, dynamic_sampling=False, max_extra_rounds=3)


def test_an_option_newer_than_the_run_set_otherwise_is_a_change(tmp_path):
    with pytest.raises(rundir.RunDirError, match=r"dynamic_sampling \(dynamic_sampling: None -> True\)"):
        _run(tmp_path, dynamic_sampling=True)


def test_a_key_no_option_has_is_still_compared(tmp_path):
    with pytest.raises(rundir.RunDirError, match="task_source"):
        _run(tmp_path, task_source={"name": "guess"})


def test_overlap_may_change_on_resume_it_changes_no_result(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / rundir.RUN_FILE).write_text(json.dumps({"lr": 0.001, "steps": 3, "overlap": 1}))
    rundir.check(out, {"lr": 0.001, "steps": 5, "overlap": 2}, resume=True)
    with pytest.raises(rundir.RunDirError, match="lr"):
        rundir.check(out, {"lr": 0.002, "steps": 5, "overlap": 2}, resume=True)
