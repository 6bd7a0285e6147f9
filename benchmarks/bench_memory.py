"""Memory of one training step: full fine-tuning against LoRA, with and without a KL reference,
and with activation checkpointing (`--recompute`) off and on.

    python benchmarks/bench_memory.py --models tiny,smollm2 --recompute --json

Each configuration runs in a process of its own (one rank, gloo), so its high-water mark is its
own: the backend is built as the trainer builds it, then one step of `--samples` trajectories of
`--tokens` tokens (half prompt, half trained) in micro-batches of `--micro-batch-size`: the
policy's forward and backward, the reference's forward when there is one, the optimizer step.
Per configuration: `resident_built_mb` (resident memory once the backend is built: weights,
optimizer state as allocated so far, the reference), `peak_mb` (the process's peak resident
memory, build included), on GPU `cuda_peak_allocated_mb`, and the parameters alive in the process
(a second model shows there). Prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

from common import ROOT, emit

CONFIGS = [
    # (name, backend, lora rank, reference)
    ("megatron-full", "megatron", 0, False),
    ("megatron-full-ref", "megatron", 0, True),
    ("megatron-lora", "megatron", 8, False),
    ("megatron-lora-ref", "megatron", 8, True),
    ("deepspeed-full", "deepspeed", 0, False),
    ("deepspeed-full-ref", "deepspeed", 0, True),
    ("deepspeed-lora", "deepspeed", 8, False),
    ("deepspeed-lora-ref", "deepspeed", 8, True),
]


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one(model: str, backend: str, lora_rank: int, reference: bool, args, *, recompute: bool = False) -> dict:
    """This process: build the backend, run one step, report its memory."""
    import gc

    import torch
    from transformers import AutoTokenizer

    from interlens_mcore import distributed
    from interlens_mcore.assets import ensure_tiny_model
    from interlens_mcore.assets.smollm2 import ensure_smollm2
    from interlens_mcore.grpo.batch import build_batch
    from interlens_mcore.types import Trajectory
    from trainers import BackendConfig, TrainerConfig, build_backend

    torch.set_num_threads(args.threads)
    distributed.init_distributed()  # a one-rank gloo world, as a plain `python` run gets
    path = ensure_smollm2() if model == "smollm2" else ensure_tiny_model()
    tok = AutoTokenizer.from_pretrained(path)
    cfg = BackendConfig(
        backend=backend, model=str(path), zero_stage=1, lora_rank=lora_rank, recompute=recompute
    )
    trainer = TrainerConfig(lr=1e-5)
    be, _ = build_backend(
        cfg,
        trainer,
        model_path=path,
        tokenizer=tok,
        temperature=1.0,
        reference=reference,
        trajectories_per_rank=args.samples,
        micro_batch_size=args.micro_batch_size,
    )
    gc.collect()
    built = _resident_mb()
    params = [o for o in gc.get_objects() if isinstance(o, torch.nn.Parameter)]
    alive = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
    trained = sum(int(getattr(p, "ds_numel", p.numel())) for p in params if p.requires_grad)
    vocab = min(tok.vocab_size, 500)
    half = args.tokens // 2
    gen = torch.Generator().manual_seed(0)
    trajs = [
        Trajectory(
            token_ids=torch.randint(3, vocab, (args.tokens,), generator=gen).tolist(),
            loss_mask=[0] * half + [1] * (args.tokens - half),
            rollout_logprobs=None,
        )
        for _ in range(args.samples)
    ]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for start in range(0, args.samples, args.micro_batch_size):
        chunk = trajs[start : start + args.micro_batch_size]
        batch = build_batch(chunk, [1.0] * len(chunk), layout=be.layout, pad_to_multiple=be.pad_to_multiple)
        mask = batch.loss_mask.to(torch.float32)
        if reference:
            ref = be.logprobs_of(batch, reference=True).detach()
        lp = be.logprobs_of(batch)
        kl = (lp - ref) if reference else 0.0
        loss = -((lp + 0.0 * kl) * mask).sum() / (args.samples * (args.tokens - half))
        be.backward(loss)
    be.optimizer_step()
    out = {
        "resident_built_mb": round(built, 1),
        "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "params_alive": alive,
        "params_trained": trained,
    }
    if torch.cuda.is_available():
        out["cuda_peak_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    ap.add_argument(
        "--configs", default=",".join(c[0] for c in CONFIGS), help="comma-separated, of: %(default)s"
    )
    ap.add_argument("--samples", type=int, default=8, help="trajectories in the step")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per trajectory (half trained)")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--recompute",
        action="store_true",
        help="also run each configuration with --recompute (activation checkpointing), as NAME+recompute",
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: MODEL,CONFIG
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    if args.one:
        model, name = args.one.split(",")
        base, _, recompute = name.partition("+")
        _, backend, rank, reference = next(c for c in CONFIGS if c[0] == base)
        print(json.dumps(one(model, backend, rank, reference, args, recompute=bool(recompute))), flush=True)
        return {}
    results: dict = {}
    for model in args.models.split(","):
        results[model] = {}
        names = args.configs.split(",")
        for name in names:
            if name not in {c[0] for c in CONFIGS}:
                ap.error(f"--configs {name!r}: expected some of {', '.join(c[0] for c in CONFIGS)}")
        for name in [*names, *(f"{n}+recompute" for n in names if args.recompute)]:
            cmd = [sys.executable, __file__, "--one", f"{model},{name}", *_child_args(args)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
            if proc.returncode != 0:
                results[model][name] = {"error": proc.stderr.strip().splitlines()[-1][:300]}
                continue
            results[model][name] = json.loads(proc.stdout.strip().splitlines()[-1])
            if not args.json:
                print(f"{model:>8} {name:>20}: {results[model][name]}", file=sys.stderr, flush=True)
    out = {
        "samples": args.samples,
        "tokens": args.tokens,
        "micro_batch_size": args.micro_batch_size,
        "repeats": 1,  # memory high-water marks do not depend on the load
        "results": results,
    }
    return emit(out, args.json)


def _child_args(args) -> list[str]:
    return [
        *("--samples", str(args.samples), "--tokens", str(args.tokens)),
        *("--micro-batch-size", str(args.micro_batch_size), "--threads", str(args.threads)),
    ]


if __name__ == "__main__":
    main()
