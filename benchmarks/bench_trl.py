"""Against a peer: TRL's GRPOTrainer versus ours, time per optimizer step on the same work.

    pip install trl==1.16.0   # benchmark-only extra (launch/bench_all.sh installs it)
    python benchmarks/bench_trl.py --json

Same tiny model, single-turn guess-a-number prompts, same batch (--batch-size completions per
step in --num-generations groups), --max-new-tokens tokens per completion (no early stop in
either), KL beta 0.005 with a reference model, one process, one thread. Ours is the Megatron
trainer through launch/train_grpo.py's options with --task-arg max_guesses=1 (see bench_train_step.py).
The first step of each is a warm-up; medians over the rest. If TRL cannot run, the JSON says
why in "trl_error". Prints one JSON object as the last line.
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


def trl_step_seconds(steps: int, batch: int, gens: int, max_new: int) -> tuple[list[float], str]:
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

    class Clock(TrainerCallback):
        walls: list[float] = []

        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

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
    trainer.train()
    return clock.walls, trl.__version__


def ours_step_seconds(steps: int, batch: int, gens: int, max_new: int) -> float:
    """Median step time of our Megatron trainer, one rank, from bench_train_step.py's JSON."""
    import json

    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_train_step.py"), "--json", "--steps", str(steps)]
    cmd += ["--batch-size", str(batch), "--num-generations", str(gens), "--max-new-tokens", str(max_new)]
    cmd += ["--task-arg", "max_guesses=1", "--lr", "2e-3", "--beta", "0.005"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["step_s"]


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
    out.update(max_new_tokens=args.max_new_tokens, ours_step_s=ours_step_seconds(*work))
    try:
        walls, version = trl_step_seconds(*work)
        trl_s = round(statistics.median(walls[1:] or walls), 4)
        out.update(trl_version=version, trl_step_s=trl_s, trl_over_ours=round(trl_s / out["ours_step_s"], 2))
    except Exception as exc:  # the benchmark reports why TRL could not run instead of failing
        out.update(trl_error=f"{type(exc).__name__}: {exc}"[:500])
    return emit(out, args.json)


if __name__ == "__main__":
    main()
