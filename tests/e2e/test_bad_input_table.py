"""docs/bad-input.md stays true: it is the rendering of tests/support/bad_inputs.py, and every row of that
table is refused as it says (one line, exit code 2, nothing written) by `main` in this process,
or by the test the row names.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.bad_inputs import SECTIONS, Refusal, render
from support.launch import ROOT, TRAIN, env

ROWS = [r for _, rows in SECTIONS for r in rows]


@pytest.fixture(scope="module", autouse=True)
def _default_policy_built():
    """The warm-started policy built before the rows: a refusal that comes after the model is
    read is still one line, but the first use of a fresh asset folder also shows the build's
    progress, which is not the refusal's."""
    from interlens_mcore.assets import ensure_default_policy

    ensure_default_policy()


def test_the_doc_is_the_table():
    assert (ROOT / "docs" / "bad-input.md").read_text() == render(), (
        "docs/bad-input.md is out of date: python tests/support/bad_inputs.py > docs/bad-input.md"
    )


def _pattern(message: str, tmp: Path) -> re.Pattern:
    parts = [re.escape(p.replace("{tmp}", str(tmp))) for p in message.split("…")]
    return re.compile("train_grpo.py: error: " + ".+".join(parts))


def _prepare(row: Refusal, tmp: Path) -> list[str]:
    for rel, text in row.files:
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    args = [a.replace("{tmp}", str(tmp)) for a in row.args]
    return args if "--output-dir" in args else [*args, "--output-dir", str(tmp / "out")]


@pytest.fixture
def shipped_registries(monkeypatch):
    """compat.swift's scheduler and environment registries as the package ships them.

    The rows run in this process, and other tests of the session register their own schedulers
    and environments (at import or in a test) and load plugin files: a refusal that lists the
    registered names must see only the package's own.
    """
    from interlens_mcore.compat.swift import gym, plugins, scheduler

    monkeypatch.setattr(plugins, "_loaded", [])
    tables = [(t, dict(t)) for t in (scheduler.multi_turns, gym.envs)]
    for table, saved in tables:
        table.clear()
        table.update({k: v for k, v in saved.items() if v.__module__.startswith("interlens_mcore.")})
    try:
        yield
    finally:
        for table, saved in tables:
            table.clear()
            table.update(saved)


def _listing(tmp: Path) -> list[str]:
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*"))


@pytest.mark.parametrize("row", [r for r in ROWS if not r.tested_by], ids=lambda r: r.what)
def test_each_row_is_refused_as_the_table_says(row, tmp_path, capsys, monkeypatch, shipped_registries):
    from support.launch import train_main

    args = _prepare(row, tmp_path)
    before = _listing(tmp_path)
    for key, value in row.env:
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    code = train_main()(args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert _pattern(row.message, tmp_path).fullmatch(lines[0]), lines[0]
    assert _listing(tmp_path) == before  # nothing written


@pytest.mark.parametrize("row", [r for r in ROWS if r.tested_by], ids=lambda r: r.what)
def test_each_row_that_needs_a_run_names_a_test_that_checks_its_message(row):
    path, name = row.tested_by.split("::")
    source = (ROOT / path).read_text()
    tests = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
    assert name in tests, row.tested_by
    # the message's fixed words, as the test spells them (its paths are f-string fields)
    words = [w for piece in re.split(r"\{tmp\}/\S*|…", row.message) for w in piece.split() if len(w) > 3]
    flat = " ".join(re.sub(r'"\s*\n\s*f?"', "", source).split())
    missing = [w for w in words if w not in flat]
    assert not missing, (row.tested_by, missing)


def test_a_refusal_under_launch_run_is_one_line_and_exit_code_2(tmp_path):
    # torchrun's own agent adds a report and exits 1; launch/run.py keeps the script's contract
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "--standalone", "--nproc_per_node=2", str(TRAIN)]
    out = tmp_path / "out"
    res = subprocess.run(
        [*cmd, "--lr", "inf", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env(),
        cwd=ROOT,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["train_grpo.py: error: --lr must be a finite number, got inf"]
    assert not out.exists()
