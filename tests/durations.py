"""Measure the test suite and write tests/DURATIONS.md: where its time goes, slowest first.

    python tests/durations.py                       # run the README's test command, then write
    python tests/durations.py -m slow --label slow  # the slow stage
    python tests/durations.py --xml main.xml --label main   # rewrite from a finished run's report

Each run's section lists the 40 slowest tests with how many processes each started (a torchrun
counts once: its launcher) and what start-up costs them: every launch of the training stack
(torchrun's launcher, then two ranks importing torch, megatron-core, DeepSpeed and transformers)
costs `startup_s` before any work, measured here by timing such a launch that does nothing. The
rest of a test's time is its work: model and asset builds, training steps, evaluation. Sections of
other labels already in the file are kept, so one file holds the before and after of a change.
The machine is shared: each section records the load average at its start and end.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "DURATIONS.md"
TOP = 40
# what a rank of a launched job imports before its first line of work
PROBE = "import deepspeed, megatron.core, transformers, trainers, interlens_mcore.cli.build\n"


@dataclass(frozen=True)
class Case:
    """One test's row of a junit report."""

    test: str  # file::name[params]
    seconds: float
    launches: int | None  # None: the run was not counting (INTERLENS_COUNT_LAUNCHES unset)
    outcome: str  # passed, failed, skipped

    @property
    def tier(self) -> str:
        parts = self.test.split("/")
        return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def read_report(path: Path) -> list[Case]:
    """Every test case of a junit XML report written by pytest (`--junitxml`)."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        name = f"{module}.py::{case.get('name')}"
        cases.append(
            Case(
                name,
                float(case.get("time", 0.0)),
                int(props["launches"]) if "launches" in props else None,
                outcome,
            )
        )
    return cases


def read_verbose_log(path: Path) -> list[Case]:
    """The tests of a `pytest -v` log whose lines carry a leading Unix time (`TIME LINE`), each
    timed from the line before it: a run stopped part way still tells what it had measured."""
    cases, last = [], None
    for line in path.read_text().splitlines():
        stamp, _, rest = line.partition(" ")
        found = re.match(r"(tests/\S+::\S.*?) (PASSED|FAILED|ERROR|SKIPPED)", rest)
        if found and last is not None:
            outcome = {"PASSED": "passed", "SKIPPED": "skipped"}.get(found.group(2), "failed")
            cases.append(Case(found.group(1), float(stamp) - last, None, outcome))
        if found or "test session starts" in rest or rest.startswith("collected"):
            last = float(stamp)
    return cases


def startup_seconds(repeats: int = 3) -> float:
    """Median wall time of a 2-rank torchrun whose ranks import the training stack and exit."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", f.name]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT, timeout=300)
        times.append(time.perf_counter() - start)
    os.unlink(f.name)
    return sorted(times)[len(times) // 2]


def section(label: str, cases: list[Case], wall_s: float | None, startup_s: float | None, loads: str) -> str:
    """The markdown of one measured run."""
    total = sum(c.seconds for c in cases)
    counts = {o: sum(c.outcome == o for c in cases) for o in ("passed", "failed", "skipped")}
    lines = [f"## {label}", ""]
    wall = f"{wall_s / 60:.1f} min wall, " if wall_s is not None else ""
    launch = "launches not counted"
    if startup_s is not None:
        launch = f"one launch of the training stack: {startup_s:.1f} s"
    lines.append(
        f"{len(cases)} tests ({counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped), "
        f"{wall}{total / 60:.1f} min in tests; {launch}; "
        f"load average {loads}."
    )
    lines += [
        "",
        "| tier | tests | minutes | launches | start-up minutes (launches x start-up) |",
        "|---|---|---|---|---|",
    ]
    for tier in sorted({c.tier for c in cases}):
        group = [c for c in cases if c.tier == tier]
        minutes = sum(c.seconds for c in group) / 60
        if startup_s is None or any(c.launches is None for c in group):
            lines.append(f"| {tier} | {len(group)} | {minutes:.1f} | not counted | |")
            continue
        launches = sum(c.launches or 0 for c in group)
        lines.append(
            f"| {tier} | {len(group)} | {minutes:.1f} | {launches} | {launches * startup_s / 60:.1f} |"
        )
    lines += [
        "",
        f"The {TOP} slowest:",
        "",
        "| s | launches | start-up s | work s | test |",
        "|---|---|---|---|---|",
    ]
    for c in sorted(cases, key=lambda c: -c.seconds)[:TOP]:
        if startup_s is None or c.launches is None:
            lines.append(f"| {c.seconds:.1f} | | | | `{c.test}` |")
            continue
        start = min(c.seconds, c.launches * startup_s)
        lines.append(
            f"| {c.seconds:.1f} | {c.launches} | {start:.0f} | {c.seconds - start:.0f} | `{c.test}` |"
        )
    return "\n".join(lines) + "\n"


def write(label: str, body: str) -> None:
    """Replace (or add) the section `label` of tests/DURATIONS.md, keeping the others."""
    head = (
        "# Where the test suite's time goes\n\n"
        "Written by `python tests/durations.py` (see its docstring). Launches: processes a test started "
        "(a torchrun counts once); start-up: what those launches cost before any work.\n\n"
    )
    text = OUT.read_text() if OUT.exists() else head
    parts = re.split(r"(?m)^(?=## )", text)
    kept = [p for p in parts[1:] if not p.startswith(f"## {label}\n")]
    OUT.write_text(parts[0] + "".join([*kept, body + "\n"]).rstrip() + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "-m", dest="marks", default="not slow", help='pytest -m expression (default "not slow")'
    )
    parser.add_argument("--label", default="main", help="the section's name in tests/DURATIONS.md")
    parser.add_argument(
        "--xml", type=Path, help="a finished run's junit XML report: write from it, run nothing"
    )
    parser.add_argument(
        "--log",
        type=Path,
        help="a time-stamped `pytest -v` log (see read_verbose_log): write from it, run nothing",
    )
    parser.add_argument("--loads", default="", help="with --xml or --log: the load averages of that run")
    args = parser.parse_args()
    wall = None
    loads = args.loads
    if args.log is not None:
        cases = read_verbose_log(args.log)
    elif args.xml is None:
        args.xml = Path(tempfile.mkdtemp()) / "report.xml"
        before = os.getloadavg()[0]
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", args.marks, f"--junitxml={args.xml}"]
        subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, INTERLENS_COUNT_LAUNCHES="1"))
        wall = time.perf_counter() - start
        loads = f"{before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    if args.log is None:
        cases = read_report(args.xml)
    counted = any(c.launches is not None for c in cases)  # else no start-up to charge them
    body = section(args.label, cases, wall, startup_seconds() if counted else None, loads or "not recorded")
    write(args.label, body)
    print(body)


if __name__ == "__main__":
    main()
