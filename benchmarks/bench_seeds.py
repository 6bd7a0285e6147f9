"""The same training job over several seeds: the rule for every change that moves a sampled run.

    python benchmarks/bench_seeds.py --seeds 3 --json                      # the default job
    python benchmarks/bench_seeds.py --seeds 3 --compare main --json       # this tree against main
    python benchmarks/bench_seeds.py --seeds 3 --vs "--beta 0.04" -- --steps 300
    python benchmarks/bench_seeds.py --seeds 2 --json -- --steps 2 --eval-every 1 --eval-size 4

Everything after `--` is launch/train_grpo.py's own options (none: its default job). Each seed
(`--seed S`, S = --first-seed, --first-seed + 1, ...) is one `torchrun --nproc_per_node=--nproc
launch/train_grpo.py` run, one after the other, in a folder of its own under --out-dir.

Two arms, interleaved seed by seed (arm A seed 0, arm B seed 0, arm A seed 1, ...), so that a
machine that slows down partway slows both alike:
- `--compare REV`: this work tree (uncommitted changes included) against REV, checked out with
  `git worktree` and run from there (PYTHONPATH puts its packages first); REV is the baseline;
- `--vs "ARGS"`: the same tree, the second arm with ARGS added to the options; the first arm is
  the baseline.

The JSON line (the last line printed): per arm, each seed's held-out success at each evaluation
(`eval/success_rate` of metrics.jsonl, with its sample count), its wall time (the whole run,
start-up and evaluations included) and its median step time (`rollout_s + train_s`); then the
final success's mean, sample standard deviation, range over the seeds and 95 % t-interval for
the mean, and with two arms the decision of docs/benchmarks.md's rule: a change that is exact in
its tests ships unless its mean final success falls outside the baseline's range over its seeds,
with at least 3 seeds per arm. A run that fails is listed with its exit code and its log's last
lines; the others still run, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common import ROOT, emit

MIN_SEEDS = 3  # per arm, for the rule to decide anything
# two-sided 95 % quantiles of Student's t by degrees of freedom (larger ones: the next smaller row)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}  # fmt: skip


@dataclass
class Arm:
    name: str
    root: Path  # the tree its runs start from
    extra: list[str] = field(default_factory=list)  # options added to the common ones
    rev: str | None = None  # the commit a --compare arm checked out


def t975(df: int) -> float:
    return T975[max(k for k in T975 if k <= df)]


def summarize(finals: Sequence[float]) -> dict:
    """Mean, sample standard deviation, range and 95 % t-interval of the seeds' final success."""
    if not finals:
        return {"n": 0}
    mean = statistics.fmean(finals)
    out: dict = {"n": len(finals), "mean": round(mean, 4), "min": min(finals), "max": max(finals)}
    if len(finals) > 1:
        sd = statistics.stdev(finals)
        half = t975(len(finals) - 1) * sd / math.sqrt(len(finals))
        out |= {"sd": round(sd, 4), "ci95": [round(mean - half, 4), round(mean + half, 4)]}
    return out


def decide(baseline: dict, candidate: dict) -> dict:
    """docs/benchmarks.md's rule: the candidate ships unless its mean falls outside the baseline's
    range over seeds; it decides only with MIN_SEEDS seeds or more in each arm."""
    n = min(baseline.get("n", 0), candidate.get("n", 0))
    if n < MIN_SEEDS:
        return {"verdict": "undecided", "why": f"{n} seeds in the smaller arm; the rule needs {MIN_SEEDS}"}
    low, high, mean = baseline["min"], baseline["max"], candidate["mean"]
    delta = round(mean - baseline["mean"], 4)
    if mean < low:
        why = f"mean {mean:.4f} below the baseline's range [{low:.4f}, {high:.4f}]"
        return {"verdict": "hold back", "why": why, "delta_mean": delta}
    where = "above" if mean > high else "within"
    why = f"mean {mean:.4f} {where} the baseline's range [{low:.4f}, {high:.4f}]"
    return {"verdict": "ships", "why": why, "delta_mean": delta}


def read_run(folder: Path) -> dict:
    """A finished run's evaluations and step times from its metrics.jsonl."""
    from trainers.report.reporter import METRICS_FILE, current, read_jsonl

    records = current(read_jsonl(folder / METRICS_FILE))
    evals = [
        {"step": r["step"], "success": r["eval/success_rate"], "n": r.get("eval/success_n")}
        for r in records
        if r.get("eval/success_rate") is not None
    ]
    steps = [r["rollout_s"] + r["train_s"] for r in records if "rollout_s" in r and "train_s" in r]
    return {
        "evals": evals,
        "final": evals[-1]["success"] if evals else None,
        "steps": len(steps),
        "step_s_median": round(statistics.median(steps), 4) if steps else None,
    }


def run_one(arm: Arm, seed: int, common: list[str], folder: Path, nproc: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    options = [*common, *arm.extra, "--seed", str(seed), "--output-dir", str(folder / "run")]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           str(arm.root / "launch" / "train_grpo.py"), *options]  # fmt: skip
    env = dict(os.environ)
    if arm.rev is not None:  # its own packages before the installed (editable) ones
        env["PYTHONPATH"] = os.pathsep.join([str(arm.root), *filter(None, [env.get("PYTHONPATH")])])
    log = folder / "log.txt"
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=arm.root, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    rc = proc.returncode
    out = {"seed": seed, "rc": rc, "wall_s": round(time.perf_counter() - t0, 2), **read_run(folder / "run")}
    done = [line for line in log.read_text(errors="replace").splitlines() if "done:" in line]
    if done:
        out["done"] = done[-1].split("done:", 1)[1].split(";")[0].strip()
    if rc != 0:
        out["log_tail"] = log.read_text(errors="replace").splitlines()[-8:]
    return out


def worktree(rev: str, where: Path) -> tuple[Path, str]:
    """REV checked out (detached) at `where`; its full commit id."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True, text=True,
            check=True,
        ).stdout.strip()  # fmt: skip
    except subprocess.CalledProcessError:
        raise SystemExit(f"bench_seeds.py: --compare {rev}: not a commit of {ROOT}") from None
    subprocess.run(["git", "worktree", "add", "--detach", str(where), commit], cwd=ROOT, check=True,
                   capture_output=True)  # fmt: skip
    # its runs must import its own packages, not the installed tree's
    probe = "import interlens_mcore, trainers; print(interlens_mcore.__file__); print(trainers.__file__)"
    env = dict(os.environ, PYTHONPATH=str(where))
    found = subprocess.run([sys.executable, "-c", probe], cwd=where, env=env, capture_output=True, text=True)
    if found.returncode != 0 or any(not Path(f).is_relative_to(where) for f in found.stdout.split()):
        raise SystemExit(f"bench_seeds.py: --compare {rev}: its runs would not import its own packages "
                         f"({found.stdout.strip() or found.stderr.strip()[-300:]})")  # fmt: skip
    return where, commit


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    common: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, common = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--seeds", type=int, default=MIN_SEEDS, help="seeds per arm (3)")
    p.add_argument("--first-seed", type=int, default=0)
    two = p.add_mutually_exclusive_group()
    two.add_argument("--compare", metavar="REV", help="a second arm: the job at commit REV (the baseline)")
    two.add_argument("--vs", metavar="ARGS", help="a second arm: the same tree with ARGS added")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (2)")
    p.add_argument("--out-dir", help="where the runs are kept (default: a new runs/seeds-<timestamp>)")
    p.add_argument("--json", action="store_true", help="only the JSON line")
    a = p.parse_args(argv)
    if a.seeds < 1:
        p.error(f"--seeds must be >= 1, got {a.seeds}")
    if a.nproc < 1:
        p.error(f"--nproc must be >= 1, got {a.nproc}")
    if a.vs is not None and not shlex.split(a.vs):
        p.error("--vs needs the options the second arm adds, e.g. --vs '--beta 0.04'")
    return a, common


def say(text: str) -> None:
    print(f"bench_seeds.py: {text}", file=sys.stderr, flush=True)


def run_arms(arms: list[Arm], seeds: list[int], common: list[str], out_dir: Path, nproc: int) -> dict:
    """Every arm's runs, seed by seed (each seed's arms one after the other), with progress lines."""
    runs: dict[str, list[dict]] = {arm.name: [] for arm in arms}
    total = len(seeds) * len(arms)
    for i, seed in enumerate(seeds):
        for j, arm in enumerate(arms):
            k = f"[{i * len(arms) + j + 1}/{total}] {arm.name} seed {seed}"
            say(f"{k} ...")
            r = run_one(arm, seed, common, out_dir / f"{arm.name.replace('/', '_')}-seed{seed}", nproc)
            runs[arm.name].append(r)
            final = "no evaluation" if r["final"] is None else f"final success {r['final']:.3f}"
            say(f"{k}: exit {r['rc']}, {final}, {r['wall_s']:.0f} s")
    return runs


def main(argv: list[str] | None = None) -> int:
    a, common = parse(argv)
    out_dir = Path(a.out_dir or ROOT / "runs" / time.strftime("seeds-%Y%m%d-%H%M%S"))
    seeds = list(range(a.first_seed, a.first_seed + a.seeds))
    arms = [Arm("this", ROOT)]
    with tempfile.TemporaryDirectory(prefix="bench-seeds-") as tmp:
        tree = Path(tmp) / "tree"
        if a.compare is not None:
            root, commit = worktree(a.compare, tree)
            arms = [Arm(a.compare, root, rev=commit), Arm("this", ROOT)]  # the baseline first
        elif a.vs is not None:
            arms.append(Arm("vs", ROOT, extra=shlex.split(a.vs)))
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            runs = run_arms(arms, seeds, common, out_dir, a.nproc)
        finally:
            if a.compare is not None:
                remove = ["git", "worktree", "remove", "--force", str(tree)]
                subprocess.run(remove, cwd=ROOT, check=False, capture_output=True)
    result: dict = {"train_args": common, "seeds": seeds, "nproc": a.nproc, "out_dir": str(out_dir)}
    result["arms"] = {}
    for arm in arms:
        ok = [r for r in runs[arm.name] if r["rc"] == 0 and r["final"] is not None]
        result["arms"][arm.name] = {
            "rev": arm.rev,
            "extra_args": arm.extra,
            "runs": runs[arm.name],
            "final": summarize([r["final"] for r in ok]),
            "wall_s_mean": round(statistics.fmean(r["wall_s"] for r in ok), 2) if ok else None,
            "step_s_median": round(statistics.median(r["step_s_median"] for r in ok), 4) if ok else None,
        }
    if len(arms) == 2:
        base, cand = (result["arms"][arm.name]["final"] for arm in arms)
        result["decision"] = {"baseline": arms[0].name, "candidate": arms[1].name, **decide(base, cand)}
    emit(result, a.json)
    return 0 if all(r["rc"] == 0 for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
