"""The megatron paths one GPU can run, each checked and reported in one JSON line.

    torchrun --standalone --nproc_per_node=1 launch/gpu_check/megatron_gpu.py

Sections (each reports "ok": true/false and its numbers; a failing one does not stop the rest):
- collectives: NCCL all_reduce of a CUDA tensor, all_gather_object, the gloo vote group and
  `check_world` at DP=1;
- logits: TP=1 logits of the tiny Qwen2 and Llama against transformers on the same device, for
  every layer spec this machine has ("local": megatron's layers and RoPE; "transformer_engine"
  when TE is installed; "sdpa_cpu" for comparison);
- grpo: a few GRPO steps through the training seam: megatron's DistributedDataParallel and
  distributed optimizer in bf16 with fp32 main weights, the colocated MegatronEngine sampling
  from the updated weights each step; then a NaN step that must be skipped;
- checkpoint: save model + megatron optimizer, load into a fresh model and optimizer, compare.

On a machine without CUDA the same script runs the CPU path (torch DDP + AdamW, the
"sdpa_cpu" spec), which is how it is tested where no GPU is lent.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from interlens_mcore import distributed

SEQS = [[5, 9, 33, 2, 100, 7], [1, 2, 3], [44, 45, 46, 47, 48, 49, 50, 51, 300, 500]]


def device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def section(name: str, results: dict, fn) -> None:
    start = time.perf_counter()
    try:
        out = fn()
        results[name] = {"ok": bool(out.pop("ok", True)), **out}
    except Exception as exc:  # reported, so the other sections still run
        tail = traceback.format_exc().strip().splitlines()[-3:]
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400], "where": tail}
    results[name]["seconds"] = round(time.perf_counter() - start, 2)


def collectives() -> dict:
    x = torch.ones(4, device=device())
    distributed.all_reduce(x)
    gathered = distributed.all_gather_object({"rank": distributed.rank()})
    group = distributed.world_check_group(timeout_s=60)
    distributed.check_world(None, group)
    try:
        distributed.check_world(ValueError("planted"), group)
        named = False
    except distributed.WorldFailure as exc:
        named = str(exc) == "rank 0 failed: ValueError: planted"
    backend = torch.distributed.get_backend()
    return {"ok": named and gathered == [{"rank": 0}], "backend": backend, "sum": float(x.sum())}


def _model(path, spec, dtype=torch.float32, **overrides):
    from interlens_mcore.megatron import build_model, load_hf_weights, load_layout

    layout = load_layout(path)
    model = build_model(layout, init_weights=False, spec=spec, params_dtype=dtype, **overrides)
    load_hf_weights(model, layout, path)
    return model.to(device()), layout


@torch.no_grad()
def logits(paths: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from interlens_mcore.megatron import forward_logits
    from interlens_mcore.megatron.spec import HAVE_TE

    torch.backends.cuda.matmul.allow_tf32 = False  # compare float32 with float32
    specs = ["sdpa_cpu"] + (["local"] if torch.cuda.is_available() else [])
    specs += ["transformer_engine"] if HAVE_TE and torch.cuda.is_available() else []
    out, ok = {"te_installed": HAVE_TE}, True
    for family, path in paths.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device()).eval()
        ref = torch.cat([hf(torch.tensor([s], device=device())).logits[0] for s in SEQS])  # [T, V]
        for spec in specs:
            # TE's fused attention runs in bf16 (its float32 fallback is the unfused kernel)
            dtype = torch.bfloat16 if spec == "transformer_engine" else torch.float32
            model, layout = _model(
                path, spec, dtype=dtype, **({"bf16": True} if dtype == torch.bfloat16 else {})
            )
            model.eval()
            cu = torch.tensor([0, 6, 9, 19], dtype=torch.int32)
            packed = forward_logits(model, layout, torch.tensor([sum(SEQS, [])]), cu)[:, : layout.vocab_size]
            batch = torch.tensor([SEQS[0], SEQS[2][:6]], device=device())
            unpacked = forward_logits(model, layout, batch)[..., : layout.vocab_size]
            diff = max(float((packed - ref).abs().max()), float((unpacked - hf(batch).logits).abs().max()))
            scale = float(ref.abs().max())
            out[f"{family}/{spec}"] = {"max_abs_diff": diff, "scale": scale, "dtype": str(dtype)}
            ok &= diff < (5e-2 if dtype == torch.bfloat16 else 1e-4) * max(scale, 1.0)
    return {"ok": ok, **out}


def grpo(path: str, root: Path) -> dict:
    """A few GRPO steps with megatron DDP + distributed optimizer + bf16, the engine in the loop."""
    from interlens_mcore.engines.base import GenerationRequest
    from interlens_mcore.grpo.advantages import group_advantages
    from interlens_mcore.grpo.batch import build_batch
    from interlens_mcore.grpo.logprobs import token_logprobs
    from interlens_mcore.grpo.loss.config import LossConfig
    from interlens_mcore.grpo.loss.objective import batch_loss
    from interlens_mcore.megatron import checkpoint as ckpt
    from interlens_mcore.megatron import forward_logits
    from interlens_mcore.megatron.engine import MegatronEngine
    from interlens_mcore.megatron.training import (
        TrainingOptions,
        build_training,
        choose_path,
        model_overrides,
    )
    from interlens_mcore.types import Trajectory

    options = TrainingOptions(lr=1e-4, grad_clip=1.0, bf16=torch.cuda.is_available())
    path_kind = choose_path()
    groups = distributed.build_groups(rollout="model_parallel")
    overrides = model_overrides(options, path=path_kind, tp_size=1)
    dtype = overrides.pop("params_dtype", torch.float32)
    model, layout = _model(path, None, dtype=dtype, **overrides)
    training = build_training(model, options, groups)
    engine = MegatronEngine(model, layout, group=groups.rollout, tp_group=groups.tp)
    prompts = [[5, 9, 33], [44, 45, 46, 47]]
    steps, per_prompt = [], 4
    for step in range(3):
        requests = [
            GenerationRequest(prompt_ids=p, max_new_tokens=12, temperature=1.0, seed=step * 100 + i)
            for i, p in enumerate(prompts * per_prompt)
        ]
        gens = engine.generate(requests)
        trajectories, rewards = [], []
        for i, (req, gen) in enumerate(zip(requests, gens, strict=True)):
            ids = list(req.prompt_ids) + gen.token_ids
            mask = [0] * len(req.prompt_ids) + [1] * len(gen.token_ids)
            trajectories.append(
                Trajectory(token_ids=ids, loss_mask=mask, rollout_logprobs=gen.logprobs, group=i % 2)
            )
            rewards.append(sum(t % 2 == 0 for t in gen.token_ids) / max(1, len(gen.token_ids)))  # even ids
        adv, _ = group_advantages(torch.tensor(rewards), torch.tensor([t.group for t in trajectories]))
        batch = build_batch(trajectories, adv, layout="packed")
        lg = forward_logits(training.train_model, layout, batch.input_ids, batch.cu_seqlens)  # [T, V]
        lp = token_logprobs(lg.float(), batch.targets[0].to(lg.device), temperature=1.0)[None].cpu()
        loss, _ = batch_loss(
            lp, batch, LossConfig(), num_tokens=batch.num_loss_tokens, num_sequences=batch.num_samples
        )
        # engine vs trainer on the same sampled tokens (same weights, before the step): rounding only
        mask = batch.loss_mask[0].bool()
        mismatch = float((lp[0][mask].detach() - batch.rollout_logprobs[0][mask]).abs().max())
        training.backward(loss)
        norm = training.step()
        steps.append({"loss": float(loss), "grad_norm": norm, "engine_vs_trainer_logprob": mismatch})
    before = [p.detach().float().clone() for p in model.parameters()]
    lg = forward_logits(training.train_model, layout, torch.tensor([[5, 9, 33]]))
    training.backward(lg.float().sum() * float("nan"))
    skipped = training.step()
    unchanged = all(
        torch.equal(a, p.detach().float()) for a, p in zip(before, model.parameters(), strict=True)
    )
    # checkpoint: save with the optimizer, load into a fresh model + optimizer, same weights
    folder = ckpt.save(root / "ckpt", model, layout, training.optimizer)
    fresh, _ = _model(path, None, dtype=dtype, **overrides)
    fresh_training = build_training(fresh, options, groups)
    ckpt.load(folder, fresh, layout, fresh_training.optimizer)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    finite = all(math.isfinite(s["grad_norm"]) and math.isfinite(s["loss"]) for s in steps)
    # bf16 engine and trainer forwards differ by rounding; the CPU path (fp32) agrees closely
    close = all(s["engine_vs_trainer_logprob"] < (0.1 if options.bf16 else 1e-4) for s in steps)
    return {
        "ok": finite and close and math.isnan(skipped) and unchanged and same,
        "path": training.path,
        "optimizer": type(training.optimizer).__name__,
        "wrapper": type(training.train_model).__name__,
        "params_dtype": str(next(model.parameters()).dtype),
        "steps": steps,
        "nan_step_skipped": math.isnan(skipped) and unchanged,
        "checkpoint_reload_equal": same,
    }


def main() -> int:
    from interlens_mcore.assets import ensure_tiny_model

    distributed.init_distributed()
    distributed.init_megatron(1)
    if torch.cuda.is_available():  # megatron's CUDA RNG tracker, which its layers fork
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    qwen = str(ensure_tiny_model())
    llama = str(
        ensure_tiny_model(arch="llama", vocab_size=515, tie_word_embeddings=False, initializer_range=0.1)
    )
    with tempfile.TemporaryDirectory() as tmp:
        section("collectives", results, collectives)
        section("logits", results, lambda: logits({"qwen2": qwen, "llama": llama}))
        section("grpo", results, lambda: grpo(qwen, Path(tmp)))
    distributed.destroy()
    results["ok"] = all(v["ok"] for v in results.values() if isinstance(v, dict))
    print(json.dumps(results, default=str))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
