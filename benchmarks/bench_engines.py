"""Engines side by side in one run: HFEngine, PrefixCachingEngine, MegatronEngine and VLLMEngine.

    .venv-vllm/bin/python benchmarks/bench_engines.py --json --plot benchmarks/results/engines.png

For each model (the tiny Qwen2 and a random 12M-parameter Qwen2), 64 conversations x 4 policy
turns x 32 tokens through `co_step` with each engine; then the exact prompts VLLMEngine got are
replayed through the bare `vllm.LLM.generate` ("raw vLLM"). Per engine: tokens/s, the ratio to
raw vLLM on the same work, `engine_time_fraction` (time inside the engine's model calls over the
rollout's wall time) and, for vLLM, `weight_sync_s` of one update from an HF model and from a
megatron-core model. Each model runs in its own process (one vLLM per process); with
`--repeats N` the models' processes alternate N times (tiny, 12M, tiny, 12M, ...) and each figure
is the median over the repetitions, every repetition's ratio listed beside it. Prints one JSON
object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import emit, make_convs, median, stop_free_policy, timed

MODELS = {
    "tiny": {},
    # hidden 384, 8 layers, 6 query / 2 key-value heads, vocabulary 512: 12.8M parameters
    "qwen2-12m": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6),
}


def rollout(engine, tok, args) -> dict:
    """One co_step run of the benchmark's conversations through `engine`."""
    from interlens_mcore import co_step

    policy = stop_free_policy(engine, tok, args.max_new_tokens)
    convs = make_convs(policy, args.conversations, args.turns)
    engine.stats.reset()
    wall, _ = timed(co_step, convs, turns=None)
    tokens = engine.stats.generated_tokens
    return {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "engine_time_fraction": round(engine.stats.forward_s / wall, 3),
    }


class Recorder:
    """An Engine that forwards to `inner` and keeps every call's requests (to replay them raw)."""

    def __init__(self, inner):
        self.inner, self.name, self.max_context, self.stats = (
            inner,
            inner.name,
            inner.max_context,
            inner.stats,
        )
        self.calls: list[list] = []

    def generate(self, requests):
        self.calls.append(list(requests))
        return self.inner.generate(requests)


def raw_vllm(llm, calls: list[list], max_context: int) -> dict:
    """The recorded calls through `llm.generate` alone: the same prompts, seeds and token caps."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    wall, tokens = 0.0, 0
    for requests in calls:
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [
            SamplingParams(
                max_tokens=min(r.max_new_tokens, max_context - len(r.prompt_ids)),
                seed=r.seed,
                temperature=r.temperature,
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
            )
            for r in requests
        ]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall += time.perf_counter() - t0
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1)}


def one_model(name: str, args) -> dict:
    import torch
    from megatron.core import parallel_state

    from interlens_mcore import HFEngine, distributed
    from interlens_mcore.assets import ensure_tiny_model, load_tiny
    from interlens_mcore.engines.prefix_cache import PrefixCachingEngine
    from interlens_mcore.engines.vllm import VLLMConfig, VLLMEngine
    from interlens_mcore.engines.weight_sync import hf_tensors, megatron_hf_tensors
    from interlens_mcore.megatron import MegatronEngine, build_model, load_hf_weights, load_layout

    torch.set_num_threads(args.threads)
    path = ensure_tiny_model(**MODELS[name]) if MODELS[name] else ensure_tiny_model()
    model, tok = load_tiny(path)
    out: dict = {"params": sum(p.numel() for p in model.parameters())}
    distributed.init_distributed()  # a one-rank world: megatron's TP group and vLLM's launcher share it
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    layout = load_layout(path)
    mcore = build_model(layout, init_weights=False)
    load_hf_weights(mcore, layout, path)
    engines = {
        "hf": HFEngine(model, tok),
        "prefix_cache": PrefixCachingEngine(model, tok),
        "megatron": MegatronEngine(mcore, layout, tokenizer=tok),
    }
    for key, engine in engines.items():
        rollout(engine, tok, argparse.Namespace(**{**vars(args), "conversations": 4, "turns": 1}))  # warm-up
        out[key] = rollout(engine, tok, args)
    config = VLLMConfig(dtype="float32", max_model_len=args.max_model_len, seed=0)
    vllm_engine = VLLMEngine.create(str(path), config)
    torch.set_num_threads(args.threads)  # vLLM lowers torch's threads for serving
    recorder = Recorder(vllm_engine)
    rollout(vllm_engine, tok, argparse.Namespace(**{**vars(args), "conversations": 4, "turns": 1}))
    out["vllm"] = rollout(recorder, tok, args)
    vllm_engine.llm.reset_prefix_cache()
    out["raw_vllm"] = raw_vllm(vllm_engine.llm, recorder.calls, vllm_engine.max_context)
    raw = out["raw_vllm"]["tokens_per_s"]
    for key in ("hf", "prefix_cache", "megatron", "vllm"):
        out[key]["ratio_to_raw_vllm"] = round(out[key]["tokens_per_s"] / raw, 3)
    out["weight_sync_s"] = {
        "hf": round(vllm_engine.update_weights(hf_tensors(model)).seconds, 4),
        "megatron": round(vllm_engine.update_weights(megatron_hf_tensors(mcore, layout)).seconds, 4),
    }
    return out


def medians(results: list[dict]) -> dict:
    """One model's repetitions as one record: each figure the median over them, and for every
    engine the ratio of each repetition (`ratios`), so the spread is in the line."""
    if len(results) == 1:
        return results[0]
    out: dict = {"params": results[0]["params"]}
    for key, first in results[0].items():
        if key == "params":
            continue
        out[key] = {k: median([r[key][k] for r in results]) for k in first}
        if "ratio_to_raw_vllm" in first:
            out[key]["ratios"] = [r[key]["ratio_to_raw_vllm"] for r in results]
    return out


def plot(result: dict, out: str) -> None:
    """Tokens/s of each engine per model, raw vLLM beside them (log scale: the models differ 10x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = ["hf", "prefix_cache", "megatron", "vllm", "raw_vllm"]
    models = [m for m in MODELS if m in result]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(engines)
    for j, engine in enumerate(engines):
        rates = [result[m][engine]["tokens_per_s"] for m in models]
        ax.bar([i + j * width for i in range(len(models))], rates, width, label=engine)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models)
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s")
    n, turns, tokens = result["conversations"], result["turns"], result["max_new_tokens"]
    ax.set_title(f"{n} conversations x {turns} turns x {tokens} tokens, through co_step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repetitions; figures are medians")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the per-model child process
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--plot", default=None, help="write a bar chart of tokens/s to this PNG")
    ap.add_argument("--plot-from", default=None, help="only plot an earlier run's JSON file (no run)")
    args = ap.parse_args(argv)
    if args.plot_from:
        plot(json.loads(open(args.plot_from).read()), args.plot or args.plot_from.replace(".json", ".png"))
        return {}
    if args.one:
        print(json.dumps(one_model(args.one, args)), flush=True)
        return {}
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "OMP_NUM_THREADS": str(args.threads),
    }
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    out: dict = {
        k: getattr(args, k) for k in ("conversations", "turns", "max_new_tokens", "threads", "repeats")
    }
    runs: dict[str, list[dict]] = {name: [] for name in args.models.split(",")}
    for rep in range(args.repeats):
        for name in runs:
            cmd = [sys.executable, __file__, "--one", name, *(argv if argv is not None else sys.argv[1:])]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if proc.returncode or not lines:
                raise RuntimeError(
                    f"bench_engines: model {name!r} failed (repetition {rep}):\n{proc.stderr[-3000:]}"
                )
            runs[name].append(json.loads(lines[-1]))
            if not args.json:
                print(f"repetition {rep} {name}: {lines[-1]}", flush=True)
    for name, results in runs.items():
        out[name] = medians(results)
    if args.plot:
        plot(out, args.plot)
    return emit(out, args.json)


if __name__ == "__main__":
    main()
