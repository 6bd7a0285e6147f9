"""Run rollouts without training and write every trajectory as JSONL, to see what a model and
an environment produce.

    torchrun --nproc_per_node=2 launch/rollout.py --output-dir runs/look --steps 1
    python launch/rollout.py --backend deepspeed --zero-stage 1 --output-dir runs/look

Writes OUTPUT_DIR/rollouts.jsonl: one object per trajectory with its reward and advantage,
the transcript, the token ids and loss mask, and per trained turn its text, ids and logprobs.
`--steps` is the number of rollout rounds. Same options as train_grpo.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# the repository root, for `interlens_mcore` and `trainers` when the package is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from backends import build_trainer, configs, import_backend  # noqa: E402
from options import UsageError, parse, validate  # noqa: E402

from interlens_mcore import parallel  # noqa: E402

OUT_FILE = "rollouts.jsonl"


def trajectory_record(t, conv, advantage: float, tokenizer, step: int) -> dict:
    """One JSON-ready trajectory: text and tokens, mask, and each trained turn's logprobs."""
    logprobs = list(t.rollout_logprobs or [])
    turns, used = [], 0
    for span in t.turns:
        ids = [
            tok for tok, m in zip(t.token_ids[span.start : span.end], t.loss_mask[span.start : span.end]) if m
        ]
        turns.append(
            {
                "start": span.start,
                "end": span.end,
                "text": tokenizer.decode(ids),
                "token_ids": ids,
                "logprobs": logprobs[used : used + len(ids)] if logprobs else None,
                "finish_reason": span.finish_reason,
            }
        )
        used += len(ids)
    return {
        "step": step,
        "conversation": t.infos.get("conversation"),
        "group": t.group,
        "reward": t.reward,
        "advantage": advantage,
        "status": t.status.value,
        "stop_reason": t.infos.get("stop_reason"),
        "messages": [{"speaker": m.speaker, "role": m.role, "content": m.content} for m in conv.messages],
        "text": tokenizer.decode(t.token_ids),
        "token_ids": t.token_ids,
        "loss_mask": t.loss_mask,
        "turns": turns,
    }


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse(argv, description=__doc__.splitlines()[0])
        validate(opts)
        configs(opts)
        if (Path(opts.output_dir) / OUT_FILE).exists():
            raise UsageError(f"--output-dir {opts.output_dir}: already holds {OUT_FILE}")
    except UsageError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"rollout.py: error: {exc}", file=sys.stderr)
        return 2
    import_backend(opts)
    torch.set_num_threads(1)
    parallel.init_distributed()
    try:
        trainer = build_trainer(opts, {})
        records = []
        for step in range(opts.steps):
            rollout = trainer.generate_rollouts(trainer.rows_for_step(step), step)
            convs = {c.id: c for c in rollout.conversations}  # this rank's own conversations
            for t, a in zip(rollout.trajectories, rollout.advantages.tolist(), strict=True):
                if t.infos.get("conversation") in convs:
                    records.append(
                        trajectory_record(t, convs[t.infos["conversation"]], a, trainer.tokenizer, step)
                    )
        everything = [r for part in parallel.all_gather_object(records) for r in part]
        if parallel.rank() == 0:
            out = Path(opts.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            tmp = out / (OUT_FILE + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in everything))
            tmp.replace(out / OUT_FILE)
            print(f"wrote {len(everything)} trajectories to {out / OUT_FILE}", file=sys.stderr)
    finally:
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
