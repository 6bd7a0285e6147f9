"""Rank 0's view of a run: a tqdm bar, OUTPUT_DIR/metrics.jsonl and reward.png at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path

METRICS_FILE, PLOT_FILE = "metrics.jsonl", "reward.png"


class MetricsLog:
    """Appends one JSON object per step; on resume, drops steps past the checkpoint first."""

    def __init__(self, output_dir: Path, *, total: int, start: int, enabled: bool):
        self.path = Path(output_dir) / METRICS_FILE
        self.enabled = enabled
        self.bar = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r["step"] < start]
        # a killed run may have logged steps after its last checkpoint: those are redone
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, desc="grpo", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        shown = {"reward": ("reward_mean", 3), "kl": ("kl", 4), "is_w": ("is_weight_mean", 3)}
        shown.update({f"win/{k.rsplit('/', 1)[1]}": (k, 2) for k in record if k.startswith("eval/win_rate/")})
        self.bar.set_postfix({name: _fmt(record.get(key), digits) for name, (key, digits) in shown.items()})
        self.bar.update(1)

    def close(self) -> None:
        if not self.enabled:
            return
        self.bar.close()
        plot_rewards(read_metrics(self.path), self.path.parent / PLOT_FILE)


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"  # None: a non-finite figure


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_rewards(records: list[dict], out: Path) -> None:
    """Reward per step (one line per seat in multi-seat games, with the fixed-opponent win rate)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    seats = sorted({k.split("/", 1)[1] for r in records for k in r if k.startswith("reward_mean/")})
    evaluated = sorted({k.rsplit("/", 1)[1] for r in records for k in r if k.startswith("eval/win_rate/")})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for seat in evaluated:
        evals = [(r["step"], r[f"eval/win_rate/{seat}"]) for r in records if f"eval/win_rate/{seat}" in r]
        ax.plot(*zip(*evals), "o--", label=f"win rate vs random, {seat}")
    if seats:
        for seat in seats:
            ax.plot(steps, [r.get(f"reward_mean/{seat}") for r in records], label=f"reward {seat}")
    else:
        mean = [r["reward_mean"] for r in records]
        std = [r["reward_std"] for r in records]
        ax.plot(steps, mean, label="reward_mean")
        lo, hi = [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)]
        ax.fill_between(steps, lo, hi, alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / win rate" if evaluated else "reward")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
