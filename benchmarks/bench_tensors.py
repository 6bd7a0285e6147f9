"""How long building the training tensors takes next to one forward + backward of the tiny model.

    python benchmarks/bench_tensors.py --json

1024 trajectories (fixed seed) of 8 trained turns with varied lengths: a prompt, then per turn
an environment message (mask 0) and a sampled reply (mask 1); one in ten has no rollout
logprobs. The forward + backward runs the tiny HF Qwen2 on the packed row one sample at a time (its
cu_seqlens chunk, plain causal attention), then vocabulary logprobs and the GRPO loss with
turn-level IS and the batch's global denominators, gradients accumulated over the chunks: what
THD varlen attention does in one kernel on GPU. Not one block-diagonal mask over windows of
several samples: CPU SDPA falls back to its math path with an explicit mask, and measured 5-10x
slower in backward than per-sample chunks (~0.2 ms / token here). The padding tail (< pad_to_multiple
tokens, no loss tokens) is not run.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from interlens_mcore.assets import load_tiny  # noqa: E402
from interlens_mcore.grpo.batch import TrainingBatch, build_batch  # noqa: E402
from interlens_mcore.grpo.logprobs import token_logprobs  # noqa: E402
from interlens_mcore.grpo.loss.config import LossConfig
from interlens_mcore.grpo.loss.metrics import finalize_metrics, merge_metrics  # noqa: E402
from interlens_mcore.grpo.loss.objective import grpo_loss  # noqa: E402
from interlens_mcore.types import Trajectory, TurnSpan  # noqa: E402


def make_trajectories(n: int, turns: int, vocab: int, seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids: list[int] = rng.integers(0, vocab, rng.integers(16, 48)).tolist()  # prompt
        mask = [0] * len(ids)
        spans, logprobs = [], []
        for _ in range(turns):
            env = rng.integers(0, vocab, rng.integers(4, 24)).tolist()
            ids += env
            mask += [0] * len(env)
            reply = rng.integers(0, vocab, rng.integers(4, 40)).tolist()
            spans.append(TurnSpan(start=len(ids), end=len(ids) + len(reply), speaker="policy", trained=True))
            ids += reply
            mask += [1] * len(reply)
            logprobs += (-rng.exponential(1.0, len(reply))).tolist()
        complete = rng.random() >= 0.1
        out.append(
            Trajectory(
                token_ids=ids,
                loss_mask=mask,
                rollout_logprobs=logprobs if complete else None,
                turns=spans,
                reward=float(rng.random()),
            )
        )
    return out


def timed_build(trajs, adv, repeats: int, **kwargs) -> tuple[TrainingBatch, float]:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        batch = build_batch(trajs, adv, **kwargs)
        best = min(best, time.perf_counter() - start)
    return batch, best * 1e3


def forward_backward(model, batch: TrainingBatch) -> tuple[float, dict[str, float]]:
    """One forward + backward over the packed row, one sample (a cu_seqlens chunk) at a time."""
    config = LossConfig(is_mode="turn_truncate", epsilon_high=0.28, beta=0.0)  # no reference model here
    model.zero_grad()
    metrics = None
    bounds = batch.cu_seqlens.tolist()
    start = time.perf_counter()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        sl = slice(a, b)  # one sample: plain causal attention, the fast SDPA path on CPU
        logits = model(input_ids=batch.input_ids[:, sl], position_ids=batch.position_ids[:, sl]).logits
        lp = token_logprobs(logits, batch.targets[:, sl])
        loss, m = grpo_loss(
            lp,
            loss_mask=batch.loss_mask[:, sl],
            advantages=batch.advantages[:, sl],
            rollout_logprobs=batch.rollout_logprobs[:, sl],
            logprobs_complete=batch.logprobs_complete,
            sample_ids=batch.sample_ids[:, sl],
            segment_ids=batch.segment_ids[:, sl],
            config=config,
            num_tokens=batch.num_loss_tokens,  # global: the chunk losses sum to the batch loss
            num_sequences=batch.num_samples,
        )
        loss.backward()
        metrics = m if metrics is None else merge_metrics(metrics, m)
    return (time.perf_counter() - start) * 1e3, finalize_metrics(metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pad-to-multiple", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()

    model, _ = load_tiny()
    trajs = make_trajectories(args.trajectories, args.turns, model.config.vocab_size, args.seed)
    adv = torch.randn(len(trajs), generator=torch.Generator().manual_seed(args.seed))
    packed, build_ms = timed_build(trajs, adv, 3, layout="packed", pad_to_multiple=args.pad_to_multiple)
    padded, build_padded_ms = timed_build(
        trajs, adv, 3, layout="padded", pad_to_multiple=args.pad_to_multiple
    )
    fwd_bwd_ms, metrics = forward_backward(model, packed)

    result = {
        "trajectories": len(trajs),
        "turns": args.turns,
        "tokens": packed.num_tokens,
        "loss_tokens": packed.num_loss_tokens,
        "build_ms": round(build_ms, 2),
        "build_padded_ms": round(build_padded_ms, 2),
        "padding_fraction_padded": round(padded.padding_fraction, 4),
        "padding_fraction_packed": round(packed.padding_fraction, 6),
        "pad_to_multiple": args.pad_to_multiple,
        "fwd_bwd_ms": round(fwd_bwd_ms, 1),
        "build_over_fwd_bwd": round(build_ms / fwd_bwd_ms, 5),
        "fwd_bwd_layout": "packed row, one causal forward per cu_seqlens chunk, grads accumulated",
        "torch_threads": torch.get_num_threads(),
        "is_sample_fraction": round(metrics["is/sample_fraction"], 4),
    }
    if not args.json:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
