"""Learning side by side: TRL's GRPOTrainer and ours on the same job, held-out accuracy against
wall time and against samples.

    python benchmarks/bench_learning.py --json                    # ours (Megatron, our engine), then TRL
    python benchmarks/bench_learning.py --json --engine vllm      # ours with vLLM, then TRL

`--engine vllm` needs vLLM, reasoning-gym and TRL in one environment (a GPU machine with
`pip install -e ".[all,vllm]"`); the CPU vLLM stage's `.venv-vllm` has neither reasoning-gym nor
TRL, so on CPU this variant has not been run.

The job is a recipe of `launch/configs/` (--config, default the SmolLM2-135M-Instruct
basic_arithmetic one): its task, group size, learning rate, KL setting, temperature and reply
length, in float32 on this CPU unless --bf16. Ours runs it with `torchrun --nproc_per_node=2
launch/train_grpo.py` for --steps steps, evaluating the held-out questions every --eval-every
steps. TRL 1.16's GRPOTrainer (one process, --threads threads, its own generation with
transformers) gets the same prompts in the same order: step s holds the rows rank 0 and rank 1
of our run draw at step s (`mix_seed(seed, step, rank)`), with shuffling off; its reward is the
task's own verifier on the same answer rule; its model is saved every --eval-every steps and
each saved model is evaluated on the same held-out questions by the same code as ours
(`launch/train_grpo.py --eval-only --model CHECKPOINT`, 2 ranks). Step 0 of both is the
initial model.

Wall time is training time only: ours, each step's `rollout_s + train_s` from metrics.jsonl
(its evaluations and checkpoints left out); TRL's, each optimizer step's time between its
trainer's step callbacks (its saves left out). Samples are completions trained on.

Written: `benchmarks/results/learning.png` (--plot) and one JSON line: each side's curve
(step, samples, wall_s, accuracy and its 95 % Wilson interval), median step phases, mean reply
length, the settings that could not be matched, and the two aims: ours at equal samples within
TRL's interval or better, and our wall time to reach TRL's final accuracy over TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import ROOT, emit, median, phase_timer

CONFIG = ROOT / "launch" / "configs" / "smollm2_basic_arithmetic.yaml"
RANKS = 2
# what TRL's GRPOTrainer does in its own way: said in the JSON line
UNMATCHED = [
    "generation: ours samples with our Megatron engine (or vLLM), TRL with transformers' generate; the "
    "same temperature and top_p, different random streams",
    "parallelism: ours 2 data-parallel ranks of 1 thread each, TRL 1 process of --threads threads "
    "(TRL on CPU runs one process)",
    "micro-batches: ours the recipe's (4 sequences, packed), TRL the whole batch of 32 padded",
    "optimizer: both torch's AdamW (betas 0.9/0.999, weight decay 0); ours eps 1e-8 as TRL's",
    "TRL's own defaults kept where ours has no counterpart: its logging and dataloader settings",
]


def recipe(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def task_source(cfg: dict):
    from interlens_mcore.tasks.reasoning_gym import source

    name = cfg["task"].removeprefix("reasoning_gym:")
    return source(name, **cfg.get("task_args", {}))


def trained_rows(cfg: dict, steps: int, seed: int) -> list[list]:
    """Per step, the rows our run's ranks draw, rank 0's first (trainers/grpo.py's rule)."""
    from interlens_mcore.engines.sampler import mix_seed

    src = task_source(cfg)
    per_rank = cfg["batch_size"] // cfg["num_generations"]
    return [
        [r for rank in range(RANKS) for r in src.rows(per_rank, seed=mix_seed(seed, step, rank))]
        for step in range(steps)
    ]


def torchrun(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={RANKS}",
        str(ROOT / "launch" / "train_grpo.py"),
    ]
    out = subprocess.run(cmd + args, capture_output=True, text=True, check=False, env=env, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(
            f"train_grpo.py {' '.join(args)} failed (exit {out.returncode}):\n{out.stderr[-3000:]}"
        )
    return out


def common_args(a) -> list[str]:
    return [
        "--config",
        str(a.config),
        "--bf16",
        str(a.bf16).lower(),
        "--eval-size",
        str(a.eval_size // RANKS),
    ]


def run_ours(a, work: Path) -> dict:
    """Our run: the curve from metrics.jsonl."""
    out_dir = work / "ours"
    args = common_args(a) + ["--steps", str(a.steps), "--eval-every", str(a.eval_every)]
    args += ["--save-every", str(a.steps), "--output-dir", str(out_dir), "--engine", a.engine]
    t0 = time.perf_counter()
    torchrun(args)
    total = time.perf_counter() - t0
    records = [
        json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    steps = sorted((r for r in records if "rollout_s" in r), key=lambda r: r["step"])
    wall, walls = 0.0, {}
    for r in steps:
        walls[r["step"]] = wall
        wall += r["rollout_s"] + r["train_s"]
    walls[len(steps)] = wall
    points = []
    for r in records:
        if "eval/success_rate" in r:
            points.append(point(r["step"], walls[r["step"]], r, a))
    return {
        "engine": a.engine,
        "curve": sorted(points, key=lambda p: p["step"]),
        "train_wall_s": round(wall, 1),
        "process_wall_s": round(total, 1),
        "step_s": median([r["rollout_s"] + r["train_s"] for r in steps[1:]]),
        "phases_s": {
            "rollout": median([r["rollout_s"] for r in steps[1:]]),
            "update": median([r["train_s"] for r in steps[1:]]),
        },
        "completion_tokens_mean": median(
            [r["completions/mean_length"] for r in steps if "completions/mean_length" in r] or [0.0]
        ),
    }


def point(step: int, wall: float, figures: dict, a) -> dict:
    return {
        "step": step,
        "samples": step * a.samples_per_step,
        "wall_s": round(wall, 1),
        "accuracy": round(figures["eval/success_rate"], 4),
        "low": round(figures["eval/success_low"], 4),
        "high": round(figures["eval/success_high"], 4),
        "n": figures["eval/success_n"],
    }


def run_trl(a, cfg: dict, work: Path) -> dict:
    """TRL's run on the same prompts; its checkpoints evaluated by our --eval-only."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from interlens_mcore.assets import ensure_smollm2

    torch.set_num_threads(a.threads)
    per_step = trained_rows(cfg, a.steps, seed=0)
    rows = [r for step in per_step for r in step]
    prompts = [
        {"prompt": [{"role": "user", "content": r.prompt()[0].content}], "row": i} for i, r in enumerate(rows)
    ]
    verifier = verifier_for(rows)

    path = ensure_smollm2()
    dtype = torch.float32  # float32 weights, as ours; --bf16 autocasts in both
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    walls: list[float] = []
    phases: list[dict[str, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()
            phases.append({})

        def on_step_end(self, *_, **__):
            walls.append(time.perf_counter() - self.t0)

    out_dir = work / "trl"
    gcfg = trl.GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=a.samples_per_step,
        gradient_accumulation_steps=1,
        num_generations=cfg["num_generations"],
        max_completion_length=cfg["max_new_tokens"],
        max_steps=a.steps,
        learning_rate=cfg["lr"],
        lr_scheduler_type="constant",  # ours: constant unless --lr-scheduler-type
        beta=cfg.get("beta", 0.0),
        temperature=cfg["temperature"],
        shuffle_dataset=False,  # the same prompts in the same order
        gradient_checkpointing=False,  # ours recomputes nothing unless --recompute
        save_strategy="steps",
        save_steps=a.eval_every,
        save_only_model=True,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=a.bf16,
        seed=0,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=verifier,
        args=gcfg,
        train_dataset=Dataset.from_list(prompts),
        processing_class=tok,
        callbacks=[Clock()],
    )
    for method in ("_generate", "_generate_and_score_completions", "_compute_loss"):
        setattr(trainer, method, phase_timer(getattr(trainer, method), method, phases))
    trainer.train()
    lengths = [
        h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h
    ]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    del trainer, model
    cum = [0.0]
    for w in walls:
        cum.append(cum[-1] + w)
    curve = []
    for step in range(0, a.steps + 1, a.eval_every):
        ckpt = path if step == 0 else out_dir / f"checkpoint-{step}"
        figures = evaluate(a, Path(ckpt), work / f"trl-eval-{step}")
        curve.append(point(step, cum[step], figures, a))
    split = [
        {
            "generate": p.get("_generate", 0.0),
            "score_and_logprobs": p.get("_generate_and_score_completions", 0.0) - p.get("_generate", 0.0),
            "loss_forward": p.get("_compute_loss", 0.0),
            "rest": w - p.get("_generate_and_score_completions", 0.0) - p.get("_compute_loss", 0.0),
        }
        for w, p in zip(walls, phases, strict=False)
    ][1:]
    return {
        "version": trl.__version__,
        "threads": a.threads,
        "curve": curve,
        "train_wall_s": round(cum[-1], 1),
        "step_s": median(walls[1:]),
        "phases_s": {k: median([p[k] for p in split]) for k in split[0]} if split else {},
        "completion_tokens_mean": median(lengths) if lengths else None,
        "reward_first_last_10pct": _ends(rewards),
    }


def verifier_for(rows: list) -> Callable[..., list[float]]:
    """TRL's reward function: each completion scored as our judge scores a reply
    (`ReasoningTask.judge`: the answer rule, then the verifier); the dataset's `row` column names
    the row."""

    def verifier(completions, row, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [rows[i].judge(text)[1] for text, i in zip(texts, row, strict=True)]

    return verifier


def _ends(values: list[float]) -> list[float] | None:
    if not values:
        return None
    k = max(1, len(values) // 10)
    return [round(sum(values[:k]) / k, 3), round(sum(values[-k:]) / k, 3)]


def evaluate(a, model: Path, out_dir: Path) -> dict:
    """The held-out figures of an HF model folder, by our --eval-only on 2 ranks."""
    out = torchrun(common_args(a) + ["--model", str(model), "--eval-only", "--output-dir", str(out_dir)])
    return json.loads(out.stdout.strip().splitlines()[-1])


def aims(ours: dict, trl_side: dict) -> dict:
    """Ours at equal samples within TRL's interval or better; our wall time to TRL's final accuracy."""
    theirs = {p["step"]: p for p in trl_side["curve"]}
    equal = [
        {
            "step": p["step"],
            "ours": p["accuracy"],
            "trl": theirs[p["step"]]["accuracy"],
            "ok": p["accuracy"] >= theirs[p["step"]]["low"],
        }
        for p in ours["curve"]
        if p["step"] in theirs
    ]
    final = trl_side["curve"][-1]["accuracy"]
    reached = next((p for p in ours["curve"] if p["accuracy"] >= final), None)
    ratio = None if reached is None else round(reached["wall_s"] / trl_side["train_wall_s"], 3)
    return {
        "equal_samples": equal,
        "equal_samples_met": all(e["ok"] for e in equal),
        "trl_final_accuracy": final,
        "ours_wall_to_trl_final_over_trl_wall": ratio,
        "wall_aim_met": ratio is not None and ratio <= 0.7,
    }


def plot(ours: dict, trl_side: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for side, label in (
        (ours, f"interlens_mcore ({ours['engine']})"),
        (trl_side, f"TRL {trl_side['version']}"),
    ):
        c = side["curve"]
        acc = [p["accuracy"] for p in c]
        err = [[p["accuracy"] - p["low"] for p in c], [p["high"] - p["accuracy"] for p in c]]
        axes[0].errorbar([p["wall_s"] / 60 for p in c], acc, yerr=err, marker="o", capsize=3, label=label)
        axes[1].errorbar([p["samples"] for p in c], acc, yerr=err, marker="o", capsize=3, label=label)
    axes[0].set_xlabel("training wall time (min)")
    axes[1].set_xlabel("completions trained on")
    axes[0].set_ylabel("held-out accuracy (95 % interval)")
    axes[0].legend()
    fig.suptitle("SmolLM2-135M-Instruct, basic_arithmetic: ours and TRL's GRPOTrainer on the same job")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=CONFIG, help="a recipe of launch/configs/")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-size", type=int, default=200, help="held-out questions in all (both ranks)")
    ap.add_argument("--engine", choices=("native", "vllm"), default="native", help="ours: --engine")
    ap.add_argument("--threads", type=int, default=2, help="TRL's torch threads")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast in both (float32 weights)")
    ap.add_argument("--skip-trl", action="store_true", help="ours only (no aims)")
    ap.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "results" / "learning.png")
    ap.add_argument(
        "--work-dir", type=Path, default=None, help="keep the runs here (default: a temporary folder)"
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.steps < 2 or a.eval_every < 1 or a.steps % a.eval_every:
        ap.error(
            "--steps must be >= 2 and a multiple of --eval-every, "
            f"got --steps {a.steps} --eval-every {a.eval_every}"
        )
    if a.eval_size < RANKS or a.eval_size % RANKS:
        ap.error(f"--eval-size must be a positive multiple of {RANKS} (the ranks), got {a.eval_size}")
    if not a.config.is_file():
        ap.error(f"--config {a.config}: no such file")
    cfg = recipe(a.config)
    a.samples_per_step = cfg["batch_size"] * RANKS
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="bench_learning."))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("INTERLENS_ASSETS", str(ROOT / ".assets"))
    out: dict = {
        "config": str(a.config.relative_to(ROOT)) if a.config.is_relative_to(ROOT) else str(a.config)
    }
    out.update(
        steps=a.steps,
        eval_every=a.eval_every,
        eval_size=a.eval_size,
        bf16=a.bf16,
        samples_per_step=a.samples_per_step,
    )
    out["ours"] = run_ours(a, work)
    if not a.skip_trl:
        out["trl"] = run_trl(a, cfg, work)
        out["unmatched"] = UNMATCHED
        out["aims"] = aims(out["ours"], out["trl"])
        plot(out["ours"], out["trl"], a.plot)
        out["plot"] = str(a.plot)
    return emit(out, a.json)


if __name__ == "__main__":
    main()
