"""The figures of one step: rewards over the world, loss and IS metrics, rollout diagnostics.

The rollout and evaluation figures are collective (one `all_gather_object` each, over every
rank's own samples), so every rank calls them in the same order; rank 0 writes the result.
Each sample is read through `samples.facts_of`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from interlens_mcore import distributed
from interlens_mcore.rollout.rollouter import Rollout
from interlens_mcore.types import Status, Trajectory

from .failures import cause_of
from .samples import facts_of, sample_figures

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# loss metric -> metrics.jsonl key (the loss module's names, `is/...` among them, are kept for the rest)
RENAMED = {"kl/ref": "kl", "clip/fraction": "clip_fraction"}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def rollout_figures(
    rollout: Rollout,
    components: dict[str, list[float | None]],
    group: ProcessGroup | None = None,
    *,
    dataset_of: Callable[[object], str | None] | None = None,
    logged: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """Rewards (total, per reward function, per seat, per dataset), success, turns, timeouts,
    completion lengths, zero-variance groups, invalid moves and tool calls over `group`.

    Collective over `group` (default: the world), each rank passing its own rollout (before any
    sharing over TP), so every sample and every advantage group counts once. `dataset_of`: the
    task source's, naming each row's dataset of a mix. `logged`: what reward functions logged
    (TRL's `log_metric`), each name's mean over the ranks as `reward_metric/<name>`.
    """
    rows = rollout.rows if dataset_of is not None else [None] * len(rollout.trajectories)
    facts = [
        facts_of(t, reward, dataset_of(row) if dataset_of is not None else None)
        # scored_rewards: a ValueError names a sample left unscored
        for t, reward, row in zip(rollout.trajectories, rollout.scored_rewards(), rows, strict=True)
    ]
    mine = {"facts": facts, "components": components, "logged": logged or {}}
    parts = distributed.all_gather_object(mine, group=group)
    every = [f for p in parts for f in p["facts"]]
    rewards = torch.tensor([f.reward for f in every])
    out: dict[str, Any] = {
        "reward_mean": float(rewards.mean()) if rewards.numel() else None,
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
    }
    names = sorted({n for p in parts for n in p["components"]})
    if len(names) > 1:  # several reward functions: each one's mean apart
        out.update(
            # over the samples it applied to: None is TRL's "not applicable"
            {
                f"reward/{n}": _mean([v for p in parts for v in p["components"].get(n, []) if v is not None])
                for n in names
            }
        )
    seats: dict[str, list[float]] = {}
    for f in every:
        seats.setdefault(f.seat, []).append(f.reward)
    if len(seats) > 1:  # several trained seats: each seat's own mean
        out.update({f"reward_mean/{k}": _mean(v) for k, v in sorted(seats.items())})
    success = [f.success for f in every if f.success is not None]
    if success:
        out["success_rate"] = _mean(success)
    out["turns_mean"] = _mean([f.turns for f in every]) or 0.0
    out["timeouts"] = sum(f.status is Status.TIMEOUT for f in every)  # samples a step time limit ended
    out["truncated"] = sum(f.status is Status.TRUNCATED for f in every)  # samples that outgrew the context
    judged = [f.judge_unparsed for f in every if f.judge_unparsed is not None]
    if judged:  # --judge-model: the replies it could not read a score from
        out["judge/unparsed"] = sum(judged)
    out.update(sample_figures([p["facts"] for p in parts]))
    for key in sorted({k for p in parts for k in p["logged"]}):
        out[f"reward_metric/{key}"] = _mean([v for p in parts for v in p["logged"].get(key, [])])
    return out


def train_figures(m: dict[str, float], *, skipped_steps: int) -> dict[str, float]:
    """The loss module's finalized metrics, under the metrics.jsonl names."""
    out = {RENAMED.get(k, k): v for k, v in m.items() if k not in ("loss/policy", "loss/kl")}
    out["loss"] = m.get("loss/policy", 0.0) + m.get("loss/kl", 0.0)
    out["step_skipped"] = int(m.get("step_skipped", 0))  # 1: a non-finite gradient norm skipped it
    out["skipped_steps"] = skipped_steps  # optimizer updates skipped so far in the run
    out["tokens"] = int(m.get("tokens", 0.0))
    return out


def evaluation_figures(rollout: Rollout) -> dict[str, float]:
    """`eval/reward`, `eval/success_rate`, and per seat `eval/reward/<seat>`, `eval/win_rate/<seat>`;
    each rate the environments reported (`sample_rates`) as `eval/rate/<name>`. Every rate comes
    with its sample count and 95 % Wilson interval (`..._n`, `..._low`, `..._high`).

    Failed samples (status FAILED: a scheduler, environment or tool raised for them) are in none
    of those figures, as they are in no loss: a failure is not a miss. They are counted instead:
    `eval/samples` (every sample played), `eval/failed_samples` and `eval/failed/<cause>`, so a
    rate's `_n` and the failed count say together why it was taken over fewer samples. Every
    task source's evaluation comes through here, whichever driver played it.

    Collective over the world: every rank evaluates its own rows.
    """
    mine: dict[str, list[float]] = {}
    failed: list[str] = []  # the cause of each failed sample
    for t, reward in zip(rollout.trajectories, rollout.scored_rewards(), strict=True):
        if t.status is Status.FAILED:
            failed.append(cause_of(t.infos.stop_reason))
            continue
        f = facts_of(t, reward)
        for key, value in sample_rates(t).items():
            mine.setdefault(key, []).append(value)
        mine.setdefault("reward", []).append(reward)
        mine.setdefault(f"reward/{f.seat}", []).append(reward)
        if f.success is not None:
            mine.setdefault("success_rate", []).append(f.success)
            if f.win is not None:
                mine.setdefault(f"win_rate/{f.seat}", []).append(f.win)
    merged: dict[str, list[float]] = {}
    causes: Counter[str] = Counter()
    samples = 0
    for part, n, part_failed in distributed.all_gather_object((mine, len(rollout.trajectories), failed)):
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
        samples += n
        causes.update(part_failed)
    # every merged list holds at least one value
    figures: dict[str, float] = {f"eval/{k}": sum(v) / len(v) for k, v in sorted(merged.items())}
    figures.update({"eval/samples": samples, "eval/failed_samples": sum(causes.values())})
    figures.update({f"eval/failed/{c}": n for c, n in sorted(causes.items())})
    if merged.get("success_rate"):
        n = len(merged["success_rate"])
        low, high = wilson_interval(figures["eval/success_rate"], n)
        figures.update({"eval/success_n": n, "eval/success_low": low, "eval/success_high": high})
    for key in (k for k in merged if k.startswith(RATE_PREFIX)):
        n = len(merged[key])
        low, high = wilson_interval(figures[f"eval/{key}"], n)
        figures.update({f"eval/{key}_n": n, f"eval/{key}_low": low, f"eval/{key}_high": high})
    return figures


RATE_PREFIX = "rate/"


def sample_rates(t: Trajectory) -> dict[str, float]:
    """The rates an environment reported for trajectory `t`: its `conv.infos` keys that start
    with `rate/`, each a value in [0, 1] for this sample (a key it did not set leaves the sample
    out of that rate's count: a rate conditioned on something, as a retry's success after a miss).
    A value that is not a number in [0, 1] is left out."""
    out = {}
    for key, value in t.infos.extra.items():
        if key.startswith(RATE_PREFIX) and isinstance(value, int | float) and not isinstance(value, bool):
            if 0.0 <= float(value) <= 1.0:
                out[key] = float(value)
    return out


def wilson_interval(rate: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (95 % by default) of a success rate measured on `n` trials.

    Binomial: a draw that counts as half a success (a tie) is treated as its mean.
    """
    if n <= 0:
        return (0.0, 1.0)
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n))
    # at a rate of 0 or 1 the bound is the rate itself, centre - half only up to rounding
    # (5.6e-17 for 0 in 3): it is clamped to hold the rate, or the plot's error bar is negative
    return (min(rate, max(0.0, centre - half)), max(rate, min(1.0, centre + half)))


def json_ready(record: dict) -> dict:
    """JSON has no NaN or inf: a non-finite figure (the loss of a skipped step) is written null."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
