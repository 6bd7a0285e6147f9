"""Plots (PNG) and the markdown results table from benchmarks/results/*.json.

python launch/bench_report.py benchmarks/results benchmarks/RESULTS.md
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display where benchmarks run
import matplotlib.pyplot as plt  # noqa: E402


def load(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def plot_growth(g: dict, out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, x in ((axes[0], "by_conversations", "conversations"), (axes[1], "by_turns", "turns")):
        rows = g[key]
        for engine in ("reuse", "reencode"):
            ax.plot([r[x] for r in rows], [r[f"{engine}_s"] for r in rows], marker="o", label=engine)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(x)
        ax.set_ylabel("rollout wall time (s)")
        ax.legend()
    axes[0].set_title(f"{g['by_conversations'][0]['turns']} turns")
    axes[1].set_title(f"{g['by_turns'][0]['conversations']} conversations")
    _save(fig, out)


def plot_turns(t: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    rows = t["runs"]
    for engine in ("reuse", "reencode"):
        ax.plot([r["turns"] for r in rows], [r[f"{engine}_s"] for r in rows], marker="o", label=engine)
    ax.set_xlabel("policy turns")
    ax.set_ylabel(f"wall time, {t['conversations']} conversations (s)")
    ax.set_title("key/value reuse vs re-encoding (medians)")
    ax.legend()
    _save(fig, out)


def plot_train(res: dict[str, dict], out: Path) -> None:
    runs = [res[k] for k in sorted(res) if k.startswith("train_") and "error" not in res[k]]
    phases = ("rollout", "batch", "forward_backward", "optimizer", "other")
    fig, ax = plt.subplots(figsize=(7, 3.8))
    bottom = [0.0] * len(runs)
    for p in phases:
        vals = [max(0.0, r[f"{p}_s"]) for r in runs]
        ax.bar([r["config"] for r in runs], vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("seconds per step (median)")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8)
    _save(fig, out)


def _save(fig, out: Path) -> None:
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def machine() -> str:
    import torch

    load = os.getloadavg()[0]
    return (
        f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), no GPU, "
        f"Python {platform.python_version()}, torch {torch.__version__}; 1-minute load average "
        f"{load:.1f} when the report was written (the cores were shared with other jobs)"
    )


def table(res: dict[str, dict]) -> list[str]:
    """Markdown rows: what was compared, the measured ratio or time, and the aim if any."""
    rows = ["| Measure | Result | Aim |", "|---|---|---|"]
    r = res.get("rollout")
    for run in (r.get("runs") or [r]) if r else []:
        rows.append(
            f"| Rollout, {run['conversations']} conv x {run['turns']} turns x {run['max_new_tokens']} tok: "
            f"co_step batched vs one at a time / vs transformers `generate` loop | "
            f"{run['speedup']}x / {run['speedup_vs_hf_generate']}x "
            f"(engine time {run['engine_time_fraction']:.0%}) "
            f"| >= 20x at 128 |"
        )
    t = res.get("turns")
    for run in t["runs"] if t else []:
        rows.append(
            f"| KV reuse vs re-encoding, {t['conversations']} conv, {run['turns']} turns "
            f"(median of {t['repeats']}) | {run['speedup']}x ({run['reuse_s']} s vs {run['reencode_s']} s), "
            f"same tokens: {run['same_tokens']} | >= 2x at 8 |"
        )
    if "tensors" in res:
        x = res["tensors"]
        rows.append(
            f"| Tensors, {x['trajectories']} traj x {x['turns']} turns: "
            "packed build / padded build / fwd+bwd | "
            f"{x['build_ms']} ms / {x['build_padded_ms']} ms / {x['fwd_bwd_ms']} ms; padding "
            f"{x['padding_fraction_packed']:.2%} packed vs {x['padding_fraction_padded']:.1%} padded | |"
        )
    if "vote" in res:
        v = res["vote"]
        rows.append(
            f"| Vote, 2 ranks, {v['rounds']} rounds | {v['vote_ms_per_round']} ms/round mean "
            f"({v['vote_ms_median']} median) vs {v['turn_ms_per_round']} ms/round of turns; "
            f"{v['vote_fraction']:.1%} of rollout time | |"
        )
    if "agent_endpoint" in res:
        a = res["agent_endpoint"]
        rows.append(
            f"| Agents through the OpenAI endpoint vs co_step, {a['agents']} agents x {a['turns']} calls x "
            f"{a['max_new_tokens']} tok, {a['model']} (median of {a['repeats']}; load at most "
            f"{a['load_max']}) | {a['endpoint_tokens_per_s']} vs {a['co_step_tokens_per_s']} tok/s: ratio "
            f"{a['ratio']}; engine calls {a['engine_calls_endpoint']} / {a['engine_calls_co_step']} | "
            ">= 0.8, equal calls |"
        )
    if "overlap" in res:
        o = res["overlap"]
        m = o.get("machine", {})
        for r in o["results"]:
            ks = sorted(int(k.split("_")[1]) for k in r if k.endswith("_speedup"))
            rows.append(
                f"| Overlap, {o['conversations']} conv x {o['turns']} turns x {o['max_new_tokens']} tok, "
                f"environment latency {r['latency_ms']} ms (median of {o['repeats']}; load "
                f"{m.get('load_before')} / {m.get('load_after')}) | off {r['overlap_1_tokens_per_s']} tok/s; "
                + "; ".join(
                    f"{k} slices {r[f'overlap_{k}_tokens_per_s']} ({r[f'overlap_{k}_speedup']}x)" for k in ks
                )
                + f"; same tokens: {o['same_tokens']} | >= 1.6x at 500 ms |"
            )
    if "soak" in res:
        s = res["soak"]
        rows.append(
            f"| Soak, 2 ranks, {s['runs']} randomised rollouts ({s['wall_s']} s) | {s['hangs']} hangs, "
            f"{s['surfaced_failures']} of {s['injected_failures']} injected failures surfaced, "
            f"{s['misaligned_trajectories']} misaligned and {s['lost_trajectories']} lost of "
            f"{s['trajectories']} trajectories, {s['timeouts']} timeouts | 0 hangs, all surfaced, 0, 0 |"
        )
    for k in sorted(res):
        if k.startswith("train_") and "error" in res[k]:
            rows.append(f"| Step, {res[k]['config']} | {res[k]['error']} | |")
        elif k.startswith("train_"):
            s = res[k]
            rows.append(
                f"| Step, {s['config']}, {s['batch_size']} conv/rank (median of {s['steps'] - 1}) | "
                f"{s['step_s']} s = rollout {s['rollout_s']} + batch {s['batch_s']} + fwd/bwd "
                f"{s['forward_backward_s']} + optimizer {s['optimizer_s']} + other {s['other_s']} | |"
            )
    if "trl" in res:
        p = res["trl"]
        got = (
            f"TRL {p['trl_version']} {p['trl_step_s']} s vs ours {p['ours_step_s']} s: "
            f"TRL/ours = {p['trl_over_ours']}"
            if "trl_step_s" in p
            else f"TRL did not run: {p.get('trl_error')}"
        )
        rows.append(f"| Step vs TRL GRPOTrainer, 1 process, {p['batch_size']} completions | {got} | >= 1 |")
    if "learning" in res and "trl" in res["learning"]:
        g = res["learning"]
        ours, theirs, aims = g["ours"]["curve"][-1], g["trl"]["curve"][-1], g["aims"]
        ratio = aims["ours_wall_to_trl_final_over_trl_wall"] or "not reached"
        rows.append(
            f"| Learning vs TRL, {g['steps']} steps x {g['samples_per_step']} completions | held-out "
            f"accuracy ours {ours['accuracy']} [{ours['low']}, {ours['high']}] in {ours['wall_s']} s, "
            f"TRL {theirs['accuracy']} [{theirs['low']}, {theirs['high']}] in {theirs['wall_s']} s; "
            f"equal samples {'met' if aims['equal_samples_met'] else 'not met'}, wall to TRL's final "
            f"/ TRL's = {ratio} | within TRL's interval; <= 0.7 |"
        )
    return rows


def main(argv: list[str]) -> int:
    folder, md = Path(argv[0]), Path(argv[1])
    res = load(folder)
    if "growth" in res:
        plot_growth(res["growth"], folder / "growth.png")
    if "turns" in res:
        plot_turns(res["turns"], folder / "turns.png")
    if any(k.startswith("train_") for k in res):
        plot_train(res, folder / "train_step.png")
    text = ["## Benchmark results", "", f"Machine: {machine()}.", "", *table(res), ""]
    text += ["Plots: `benchmarks/results/growth.png`, `turns.png`, `train_step.png`.", ""]
    md.write_text("\n".join(text))
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
