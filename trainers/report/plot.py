"""`reward.png`: reward with its spread, KL, loss and success rate per step (redrawn at checkpoints)."""

from __future__ import annotations

import os
from pathlib import Path

from .record import RATE_PREFIX


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def rate_keys(keys: list[str]) -> list[str]:
    """The rates drawn: success and win rates, and each rate the environments reported
    (`eval/rate/NAME`, with its count; not its per-seat parts `eval/rate/NAME/SEAT`)."""
    rates = [k for k in keys if k.startswith("eval/win_rate/") or k in ("eval/success_rate", "success_rate")]
    reported = f"eval/{RATE_PREFIX}"
    return rates + [k for k in keys if k.startswith(reported) and f"{k}_n" in keys and k.count("/") == 2]


def plot_run(records: list[dict], out: Path) -> None:
    """Three panels: rewards (per seat when several train) and success rates; KL; loss."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    train = [r for r in records if "reward_mean" in r]
    keys = sorted({k for r in records for k in r})
    seats = [k for k in keys if k.startswith("reward_mean/")]
    rates = rate_keys(keys)
    fig, (ax, kl, loss) = plt.subplots(1, 3, figsize=(12, 3.5))
    for key in seats or ["reward_mean"]:
        ax.plot(*_series(train, key), label=key.replace("reward_mean/", "reward "))
    if not seats and train:
        steps, mean = _series(train, "reward_mean")
        std = [r.get("reward_std") or 0.0 for r in train if r.get("reward_mean") is not None]
        ax.fill_between(
            steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2
        )
    for key in rates:
        style = "-" if key == "success_rate" else "o--"
        steps, values = _series(records, key)
        low, high = (
            ("eval/success_low", "eval/success_high")
            if key == "eval/success_rate"
            else (f"{key}_low", f"{key}_high")
        )
        bounds = [(r.get(low), r.get(high)) for r in records if r.get(key) is not None]
        intervals = [(lo, hi) for lo, hi in bounds if lo is not None and hi is not None]
        if key.startswith("eval/") and intervals and len(intervals) == len(bounds):
            # the 95 % Wilson interval of each held-out measurement
            spread = [
                [v - lo for v, (lo, _) in zip(values, intervals)],
                [hi - v for v, (_, hi) in zip(values, intervals)],
            ]
            ax.errorbar(steps, values, yerr=spread, fmt=style, capsize=3, label=key + " (95 % CI)")
        else:
            ax.plot(steps, values, style, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / rate")
    ax.legend(loc="best", fontsize=6)
    for panel, key in ((kl, "kl"), (loss, "loss")):
        panel.plot(*_series(train, key))
        panel.set_xlabel("step")
        panel.set_ylabel(key)
    fig.tight_layout()
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
