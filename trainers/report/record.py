"""The figures of one step: rewards over the DP group, loss and IS metrics, rollout diagnostics.

Everything here is collective over the DP group (one `all_gather_object`), so every rank calls
it in the same order; rank 0 writes the result.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from interlens_mcore import distributed
from interlens_mcore.rollout.rollouter import Rollout

# loss metric -> metrics.jsonl key (the loss module's names are kept as they are for the rest)
RENAMED = {
    "kl/ref": "kl",
    "is/kl_k3": "is_kl_k3",
    "is/sample_fraction": "is_sample_fraction",
    "is/weight_mean": "is_weight_mean",
    "is/weight/max": "is_weight_max",
    "clip/fraction": "clip_fraction",
}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def rollout_figures(rollout: Rollout, components: dict[str, list[float]], group: Any) -> dict[str, Any]:
    """Rewards (total, per reward function, per seat), success, turns and timeouts over `group`."""
    trajectories = rollout.trajectories
    mine = {
        "reward": rollout.scored_rewards(),
        "components": components,
        "seats": rollout.seat_rewards(),
        "success": [t.infos.success for t in trajectories if t.infos.success is not None],
        "turns": [t.infos.turns for t in trajectories],
        "timeouts": rollout.timeouts,
        "truncated": rollout.truncated,
    }
    parts = distributed.all_gather_object(mine, group=group)
    rewards = torch.tensor([r for p in parts for r in p["reward"]])
    out: dict[str, Any] = {
        "reward_mean": float(rewards.mean()) if rewards.numel() else None,
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
    }
    names = sorted({n for p in parts for n in p["components"]})
    if len(names) > 1:  # several reward functions: each one's mean apart
        out.update(
            {f"reward/{n}": _mean([v for p in parts for v in p["components"].get(n, [])]) for n in names}
        )
    seats: dict[str, list[float]] = {}
    for p in parts:
        for seat, values in p["seats"].items():
            seats.setdefault(seat, []).extend(values)
    if len(seats) > 1:  # several trained seats: each seat's own mean
        out.update({f"reward_mean/{k}": _mean(v) for k, v in sorted(seats.items())})
    success = [s for p in parts for s in p["success"]]
    if success:
        out["success_rate"] = _mean(success)
    turns = [n for p in parts for n in p["turns"]]
    out["turns_mean"] = _mean(turns) or 0.0
    out["timeouts"] = sum(p["timeouts"] for p in parts)  # samples a step time limit ended
    out["truncated"] = sum(p["truncated"] for p in parts)  # samples that outgrew the context
    return out


def train_figures(m: dict[str, float], *, skipped_steps: int) -> dict[str, Any]:
    """The loss module's finalized metrics, under the metrics.jsonl names."""
    out = {RENAMED.get(k, k): v for k, v in m.items() if k not in ("loss/policy", "loss/kl")}
    out["loss"] = m.get("loss/policy", 0.0) + m.get("loss/kl", 0.0)
    out["step_skipped"] = int(m.get("step_skipped", 0))  # 1: a non-finite gradient norm skipped it
    out["skipped_steps"] = skipped_steps  # optimizer updates skipped so far in the run
    out["tokens"] = int(m.get("tokens", 0.0))
    return out


def evaluation_figures(rollout: Rollout) -> dict[str, float]:
    """`eval/reward`, `eval/success_rate`, and per seat `eval/reward/<seat>`, `eval/win_rate/<seat>`.

    Collective over the world: every rank evaluates its own rows.
    """
    mine: dict[str, list[float]] = {}
    for t, reward in zip(rollout.trajectories, rollout.scored_rewards(), strict=True):
        mine.setdefault("reward", []).append(reward)
        mine.setdefault(f"reward/{t.participant}", []).append(reward)
        if t.infos.success is not None:
            mine.setdefault("success_rate", []).append(t.infos.success)
            outcome = t.infos.outcome
            if outcome is not None and t.participant in outcome:
                mine.setdefault(f"win_rate/{t.participant}", []).append(float(outcome[t.participant]))
    merged: dict[str, list[float]] = {}
    for part in distributed.all_gather_object(mine):
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    # every merged list holds at least one value
    figures: dict[str, float] = {f"eval/{k}": sum(v) / len(v) for k, v in sorted(merged.items())}
    if merged.get("success_rate"):
        n = len(merged["success_rate"])
        low, high = wilson_interval(figures["eval/success_rate"], n)
        figures.update({"eval/success_n": n, "eval/success_low": low, "eval/success_high": high})
    return figures


def wilson_interval(rate: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (95 % by default) of a success rate measured on `n` trials.

    Binomial: a draw that counts as half a success (a tie) is treated as its mean.
    """
    if n <= 0:
        return (0.0, 1.0)
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n))
    return (max(0.0, centre - half), min(1.0, centre + half))


def json_ready(record: dict) -> dict:
    """JSON has no NaN or inf: a non-finite figure (the loss of a skipped step) is written null."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
