"""Against a peer: TRL's GRPOTrainer versus ours, time per optimizer step on the same work.

    pip install trl==1.16.0   # benchmark-only extra (launch/bench_all.sh installs it)
    python benchmarks/bench_trl.py --json

Same tiny model, single-turn guess-a-number prompts, same batch (--batch-size completions per
step in --num-generations groups), --max-new-tokens tokens per completion (no early stop in
either), KL beta 0.005 with a reference model, one process, one thread. Ours is the Megatron
trainer through launch/train_grpo.py's options with --task-arg max_guesses=1 (see bench_train_step.py).
The first step of each is a warm-up; medians over the rest, the step's and each phase's: ours
from bench_train_step.py (rollout, batch, forward/backward, optimizer, other), TRL's by timing
its own methods (generate, scoring with the old and reference log-probs, the loss's forward, the
rest: backward and optimizer). If TRL cannot run, the JSON says why in "trl_error". Prints
one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from common import ROOT, emit

from interlens_mcore.assets import ensure_tiny_model
from interlens_mcore.tasks.guess import guess_tasks


def trl_step_seconds(steps: int, batch: int, gens: int, max_new: int) -> tuple[list[float], str, list[dict]]:
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    path = ensure_tiny_model()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
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
        bf16=False,
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
        setattr(trainer, method, _timed(getattr(trainer, method), method, phases))
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
    return clock.walls, trl.__version__, split


def _timed(fn, name: str, phases: list[dict[str, float]]):
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if phases:
                phases[-1][name] = phases[-1].get(name, 0.0) + time.perf_counter() - t0

    return wrapped


def ours_step(steps: int, batch: int, gens: int, max_new: int) -> dict:
    """Our Megatron trainer, one rank: bench_train_step.py's JSON (medians of the step and its phases)."""
    import json

    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_train_step.py"), "--json", "--steps", str(steps)]
    cmd += ["--batch-size", str(batch), "--num-generations", str(gens), "--max-new-tokens", str(max_new)]
    cmd += ["--task-arg", "max_guesses=1", "--lr", "2e-3", "--beta", "0.005"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    work = (args.steps, args.batch_size, args.num_generations, args.max_new_tokens)
    out = {"steps": args.steps, "batch_size": args.batch_size, "num_generations": args.num_generations}
    ours = ours_step(*work)
    out.update(max_new_tokens=args.max_new_tokens, ours_step_s=ours["step_s"])
    out["ours_phases_s"] = {
        k.removesuffix("_s"): ours[k]
        for k in ("rollout_s", "batch_s", "forward_backward_s", "optimizer_s", "other_s")
    }
    try:
        walls, version, split = trl_step_seconds(*work)
        trl_s = round(statistics.median(walls[1:] or walls), 4)
        out.update(trl_version=version, trl_step_s=trl_s, trl_over_ours=round(trl_s / out["ours_step_s"], 2))
        measured = split[1:] or split
        out["trl_phases_s"] = {k: round(statistics.median(p[k] for p in measured), 4) for k in measured[0]}
    except Exception as exc:  # the benchmark reports why TRL could not run instead of failing
        out.update(trl_error=f"{type(exc).__name__}: {exc}"[:500])
    return emit(out, args.json)


if __name__ == "__main__":
    main()
