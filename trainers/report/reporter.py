"""Rank 0's view of a run: metrics to jsonl / tensorboard / wandb, sample completions, the plot,
a progress bar and one end-of-run summary line. Every logger gets the same keys.

Files in the output folder: `metrics.jsonl` (one object per step), `completions.jsonl`,
`reward.png`, `tensorboard/` and `wandb/`. A line once written stays: on resume, the lines of
the steps the resumed run writes again (those of its first step and after, an evaluation of the
checkpoint's weights excepted) get `"superseded": true` (see `current`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from .plot import plot_run

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm
    from wandb.sdk.wandb_run import Run

METRICS_FILE, COMPLETIONS_FILE, PLOT_FILE = "metrics.jsonl", "completions.jsonl", "reward.png"
SUPERSEDED = "superseded"


def read_jsonl(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def current(records: list[dict]) -> list[dict]:
    """The records no resumption has superseded: each step's latest."""
    return [r for r in records if not r.get(SUPERSEDED)]


def _redone(record: dict, start: int) -> bool:
    """Whether a run resumed at `start` writes this record's step again.

    An evaluation-only record of step `start` (a finished run's last line) evaluated the very
    weights the resumption loads: it stays current.
    """
    evaluation_only = all(k == "step" or k.startswith("eval/") for k in record)
    return record["step"] > start or (record["step"] == start and not evaluation_only)


def _mark_superseded(path: Path, start: int) -> None:
    """Mark (never drop) the lines of steps a run resumed at `start` writes again."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    marked = []
    for line in lines:
        record = json.loads(line) if line.strip() else None
        if record is not None and not record.get(SUPERSEDED) and _redone(record, start):
            line = json.dumps({**record, SUPERSEDED: True}) + "\n"
        marked.append(line if line.endswith("\n") else line + "\n")  # the next append starts a line
    if marked != lines:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(marked))
        os.replace(tmp, path)


def progress_bar(total: int, *, initial: int = 0, desc: str = "grpo") -> tqdm:
    """The progress line on stderr: `desc`, steps done of `total`, figures as its postfix."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, file=sys.stderr)


def fmt(value: float | None, digits: int) -> str:
    """A figure of the progress line: `-` when missing or not finite."""
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


class Reporter:
    """Writes what rank 0 sees; on other ranks every method does nothing."""

    def __init__(
        self,
        output_dir: Path,
        *,
        reporters: list[str],
        total: int,
        start: int,
        enabled: bool,
        run_info: dict[str, object] | None = None,
    ):
        self.out, self.enabled, self.total, self.start = Path(output_dir), enabled, total, start
        self.t0 = time.perf_counter()
        self.tb: SummaryWriter | None = None
        self.wandb: Run | None = None
        self.bar: tqdm | None = None  # set whenever enabled
        if not enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        for name in (METRICS_FILE, COMPLETIONS_FILE):
            _mark_superseded(self.out / name, start)
        if "tensorboard" in reporters:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.out / "tensorboard"), purge_step=start)
        if "wandb" in reporters:
            import wandb

            # offline unless the user set WANDB_MODE (None: wandb reads it) or has an API key:
            # no network needed
            mode: Literal["online", "offline"] | None = (
                None
                if os.environ.get("WANDB_MODE")
                else "online"
                if os.environ.get("WANDB_API_KEY")
                else "offline"
            )
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "interlens_mcore"),
                name=self.out.name,
                dir=str(self.out),
                config=run_info or {},
                mode=mode,
                resume="allow",
                id=self.out.name.replace(".", "-"),
            )
        self.bar = progress_bar(total, initial=start)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with (self.out / METRICS_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for key, value in numbers.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)
        if "reward_mean" in record and self.bar is not None:
            kl = "kl_in_reward/kl" if "kl_in_reward/kl" in record else "kl"  # where the KL is
            shown = {"reward": ("reward_mean", 3), "kl": (kl, 4), "is_w": ("is/weight_mean", 3)}
            postfix = {name: fmt(record.get(k), d) for name, (k, d) in shown.items()}
            if "eval/samples" in record or "eval/success_rate" in record:
                postfix["eval"] = evaluated(record, 2)
            self.bar.set_postfix(postfix)
            self.bar.update(1)

    def log_sft(self, record: dict) -> None:
        """A supervised warm-up step (`sft_step`, `sft/` figures): a line of metrics.jsonl at the run's
        step 0, tensorboard and wandb along `sft_step` (the GRPO steps' own axis is untouched), and
        the progress bar's postfix."""
        if not self.enabled:
            return
        with (self.out / METRICS_FILE).open("a") as f:
            f.write(json.dumps({"step": self.start, **record}) + "\n")
        numbers = {k: v for k, v in record.items() if k.startswith("sft/") and isinstance(v, (int, float))}
        if self.tb is not None:
            for key, value in numbers.items():
                self.tb.add_scalar(key, value, record["sft_step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({**numbers, "sft_step": record["sft_step"]})
        if self.bar is not None:
            loss, tokens = record.get("sft/loss"), record.get("sft/tokens")
            self.bar.set_postfix_str(
                f"sft step {record['sft_step']}: loss {fmt(loss, 4)}, {fmt(tokens, 0)} tokens"
            )

    def note(self, text: str) -> None:
        """What the run is doing now, beside the progress bar until the step's record replaces it."""
        if self.bar is not None:  # set whenever enabled
            self.bar.set_postfix_str(text)

    def warn(self, line: str) -> None:
        """One line on stderr, above the progress bar (a health warning)."""
        if self.bar is not None:  # set whenever enabled
            self.bar.write(line, file=sys.stderr)

    def completions(self, step: int, samples: list[dict]) -> None:
        """Full trajectories of one step (text, reward, advantage, per-turn finish reasons)."""
        if not self.enabled or not samples:
            return
        with (self.out / COMPLETIONS_FILE).open("a") as f:
            for s in samples:
                f.write(json.dumps({"step": step, **s}) + "\n")
        rows = [[s["seat"], f"{s['reward']:.3f}", f"{s['advantage']:.3f}", s["text"]] for s in samples]
        if self.tb is not None:
            table = "| seat | reward | advantage | text |\n|---|---|---|---|\n"
            table += "".join("| " + " | ".join(_cell(c) for c in row) + " |\n" for row in rows)
            self.tb.add_text("completions", table, step)
        if self.wandb is not None:
            import wandb

            self.wandb.log(
                {"completions": wandb.Table(columns=["seat", "reward", "advantage", "text"], data=rows)},
                step=step,
            )

    def plot(self) -> None:
        if self.enabled:
            plot_run(current(read_jsonl(self.out / METRICS_FILE)), self.out / PLOT_FILE)

    def close(self, *, steps: int, failed: bool = False) -> str | None:
        """Final plot, loggers closed; returns (and prints) the one-line summary.

        A failed run only closes its loggers: what was written stays, and the error is its
        last line.
        """
        if not self.enabled:
            return None
        if self.bar is not None:
            self.bar.close()
        if failed:
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish(exit_code=1)
            return None
        self.plot()
        records = current(read_jsonl(self.out / METRICS_FILE))
        line = summary(records, out=self.out, steps=steps, wall_s=time.perf_counter() - self.t0)
        print(line, file=sys.stderr)
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        return line


def summary(records: list[dict], *, out: Path, steps: int, wall_s: float) -> str:
    """`done: N steps in T; reward first/last 10 %: a -> b; eval/success_rate: c -> d; outputs in DIR`,
    each evaluation's rate with its interval, its sample count and its failed samples (`evaluated`)."""
    train = [r["reward_mean"] for r in records if r.get("reward_mean") is not None]
    parts = [f"done: {steps} steps in {_duration(wall_s)} (this process)"]
    if train:
        k = max(1, len(train) // 10)
        parts.append(f"reward_mean first/last 10 %: {_mean(train[:k]):.3f} -> {_mean(train[-k:]):.3f}")
    evals = [r for r in records if r.get("eval/success_rate") is not None or r.get("eval/failed_samples")]
    if evals:
        first, last = (evaluated(r, 3, interval=True) for r in (evals[0], evals[-1]))
        parts.append(f"eval/success_rate: {first} -> {last}")
    parts.append(f"outputs in {out}")
    return "; ".join(parts)


def evaluated(record: dict, digits: int, *, interval: bool = False) -> str:
    """An evaluation's success rate with what it was taken over: `0.500 [0.337, 0.663] of 28, 4 of
    32 failed` (the interval only with `interval`; the failures only when some sample failed)."""
    rate = record.get("eval/success_rate")
    text = fmt(rate, digits)
    if rate is not None and interval and record.get("eval/success_low") is not None:
        text += f" [{record['eval/success_low']:.3f}, {record['eval/success_high']:.3f}]"
    if rate is not None and record.get("eval/success_n") is not None:
        text += f" of {record['eval/success_n']}"
    if record.get("eval/failed_samples"):
        text += f", {record['eval/failed_samples']} of {record['eval/samples']} failed"
    return text


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", "<br>")
