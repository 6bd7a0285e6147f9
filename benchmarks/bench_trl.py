"""Against a peer: TRL's GRPOTrainer versus ours, time per optimizer step on the same work.

    pip install trl==1.16.0   # benchmark-only extra (launch/bench_all.sh installs it)
    python benchmarks/bench_trl.py --json --steps 12 --repeats 3
    python benchmarks/bench_trl.py --json --model smollm2 --bf16 --max-new-tokens 32 --threads 2

Same model (--model: the tiny Qwen2 or SmolLM2-135M-Instruct), single-turn guess-a-number
prompts, same batch (--batch-size completions per step in --num-generations groups), up to
--max-new-tokens tokens per completion, temperature 1, KL beta 0.005 with a reference model, one
process, --threads threads, float32 or (--bf16) bfloat16 autocast in both, activation
checkpointing in both or (the default, though TRL's own default is on) in neither. Ours is the Megatron
trainer through launch/train_grpo.py's options with --task-arg max_guesses=1 (see
bench_train_step.py). The first step of each run is a warm-up; medians over the rest, the step's
and each phase's: ours from bench_train_step.py (rollout, batch, forward/backward, optimizer,
other), TRL's by timing its own methods (generate, scoring with the old and reference log-probs,
the loss's forward, the rest: backward and optimizer). With --repeats N the two alternate N times
(ours, TRL, ours, TRL, ...): each figure is the median over the runs, each run's ratio listed.
Mean reply lengths are in the line (a model that stops early does less work). If TRL cannot run,
the JSON says why in "trl_error". Prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from common import ROOT, emit, median, phase_timer

from interlens_mcore.assets import ensure_smollm2, ensure_tiny_model
from interlens_mcore.tasks.guess import guess_tasks


def trl_step_seconds(args) -> tuple[list[float], str, list[dict], list[float]]:
    """TRL's run: each step's wall time, its version, each step's phases and reply lengths."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    steps, batch, gens, max_new = args.steps, args.batch_size, args.num_generations, args.max_new_tokens
    path = ensure_smollm2() if args.model == "smollm2" else ensure_tiny_model()
    # float32 weights as ours (transformers loads a checkpoint in its own dtype: SmolLM2's is bfloat16)
    tok, model = (
        AutoTokenizer.from_pretrained(path),
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
    )
    tasks = guess_tasks(steps * batch // gens, seed=0)
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": t.prompt()[0].content}]} for t in tasks]
    )

    def digits(completions, **_):  # the form part of the guess reward: a cheap stand-in
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [sum(ch.isdigit() for ch in s) / max(1, len(s)) for s in texts]

    phases: list[dict[str, float]] = []  # one per step: seconds in each timed method

    class Clock(TrainerCallback):
        walls: list[float] = []

        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()
            phases.append({})

        def on_step_end(self, *_, **__):
            self.walls.append(time.perf_counter() - self.t0)

    cfg = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_trl."),
        per_device_train_batch_size=batch,
        num_generations=gens,
        max_completion_length=max_new,
        max_steps=steps,
        learning_rate=2e-3,
        beta=0.005,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=args.bf16,
        # TRL's GRPO default is on; ours is off (--recompute): the same in both, as asked
        gradient_checkpointing=args.recompute,
        # every reply max_completion_length tokens, as ours are here (the same work: no early end)
        generation_kwargs={"min_new_tokens": max_new},
        seed=0,
    )
    clock = Clock()
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=digits,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[clock],
    )
    # its phases, by wrapping the trainer's own methods on the instance (TRL 1.16 names):
    # generation, then scoring with the old / reference log-probs, then the loss's forward; the
    # rest of the step is backward and the optimizer
    for method in ("_generate", "_generate_and_score_completions", "_compute_loss"):
        setattr(trainer, method, phase_timer(getattr(trainer, method), method, phases))
    trainer.train()
    split = []
    for wall, ph in zip(clock.walls, phases, strict=False):
        gen, scored, loss = (
            ph.get(m, 0.0) for m in ("_generate", "_generate_and_score_completions", "_compute_loss")
        )
        split.append(
            {
                "generate": gen,
                "score_and_logprobs": scored - gen,
                "loss_forward": loss,
                "rest": wall - scored - loss,
            }
        )
    lengths = [
        h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h
    ]
    return clock.walls, trl.__version__, split, lengths


def ours_step(args) -> dict:
    """Our Megatron trainer, one rank: bench_train_step.py's JSON (medians of the step and its phases)."""
    import json

    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_train_step.py"),
        "--json",
        "--steps",
        str(args.steps),
    ]
    cmd += ["--batch-size", str(args.batch_size), "--num-generations", str(args.num_generations)]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), "--temperature", "1.0", "--model", args.model]
    cmd += ["--task-arg", "max_guesses=1", "--lr", "2e-3", "--beta", "0.005", "--threads", str(args.threads)]
    cmd += ["--micro-batch-size", str(args.batch_size)] + (["--bf16"] if args.bf16 else [])
    cmd += ["--recompute"] if args.recompute else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"bench_train_step.py failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def trl_run(args) -> dict:
    """One TRL run as medians over its steps after the first."""
    walls, version, split, lengths = trl_step_seconds(args)
    measured = split[1:] or split
    return {
        "version": version,
        "step_s": median(walls[1:] or walls),
        "phases_s": {k: median([p[k] for p in measured]) for k in measured[0]},
        "completion_tokens_mean": round(statistics.median(lengths[1:] or lengths), 2) if lengths else None,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast in both (float32 weights)")
    ap.add_argument(
        "--recompute", action="store_true", help="activation checkpointing in both (TRL's default)"
    )
    ap.add_argument("--repeats", type=int, default=1, help="interleaved runs of each; figures are medians")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.steps < 2:
        ap.error(
            "--repeats must be >= 1 and --steps >= 2 (the first is a warm-up), "
            f"got --repeats {args.repeats} --steps {args.steps}"
        )
    torch.set_num_threads(args.threads)
    out: dict = {
        k: getattr(args, k) for k in ("model", "steps", "batch_size", "num_generations", "max_new_tokens")
    }
    out.update(threads=args.threads, bf16=args.bf16, recompute=args.recompute, repeats=args.repeats)
    ours_runs, trl_runs, trl_error = [], [], None
    for _ in range(args.repeats):
        ours_runs.append(ours_step(args))
        if trl_error is None:
            try:
                trl_runs.append(trl_run(args))
            except Exception as exc:  # the benchmark reports why TRL could not run instead of failing
                trl_error = f"{type(exc).__name__}: {exc}"[:500]
    phases = ("rollout_s", "batch_s", "forward_backward_s", "optimizer_s", "other_s")
    out["ours_step_s"] = median([r["step_s"] for r in ours_runs])
    out["ours_phases_s"] = {k.removesuffix("_s"): median([r[k] for r in ours_runs]) for k in phases}
    out["ours_completion_tokens"] = median([r["completion_tokens_mean"] for r in ours_runs])
    if trl_error:
        out["trl_error"] = trl_error
    if trl_runs:
        out["trl_version"] = trl_runs[0]["version"]
        out["trl_step_s"] = median([r["step_s"] for r in trl_runs])
        out["trl_over_ours"] = round(out["trl_step_s"] / out["ours_step_s"], 2)
        out["trl_over_ours_each"] = [round(t["step_s"] / o["step_s"], 2) for o, t in zip(ours_runs, trl_runs)]
        out["trl_phases_s"] = {
            k: median([r["phases_s"][k] for r in trl_runs]) for k in trl_runs[0]["phases_s"]
        }
        lengths = [r["completion_tokens_mean"] for r in trl_runs if r["completion_tokens_mean"] is not None]
        out["trl_completion_tokens"] = median(lengths) if lengths else None
    return emit(out, args.json)


if __name__ == "__main__":
    main()
