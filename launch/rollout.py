"""Run rollouts without training and write every trajectory as JSONL, to see what a model and
a task produce.

    torchrun --nproc_per_node=2 launch/rollout.py --output-dir runs/look --steps 1
    torchrun --nproc_per_node=2 launch/rollout.py --checkpoint runs/grpo --output-dir runs/look-trained
    python launch/rollout.py --backend deepspeed --zero-stage 1 --output-dir runs/look

Writes OUTPUT_DIR/rollouts.jsonl: one object per trajectory with its seat, reward and
advantage, the transcript, the token ids and loss mask, and per trained turn its text, ids and
logprobs. `--steps` is the number of rollout rounds; `--checkpoint` loads the weights of a
training run (its newest intact checkpoint) or of one `step-NNNNNN` folder first. Same
options as train_grpo.py.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from interlens_mcore import distributed
from interlens_mcore.cli import quiet  # noqa: F401  (before megatron / DeepSpeed are imported)
from interlens_mcore.cli.args import UsageError, parse
from interlens_mcore.cli.build import build_trainer, check
from trainers import checkpoint

OUT_FILE = "rollouts.jsonl"


@dataclass(frozen=True, kw_only=True)
class RolloutScriptConfig:
    checkpoint: str | None = field(
        default=None,
        metadata={"help": "a training run folder (its newest intact checkpoint) or a step-NNNNNN folder"},
    )


def checkpoint_folder(path: str) -> Path:
    """A `step-NNNNNN` folder, or the newest intact one of a run folder; UsageError naming --checkpoint."""
    p = Path(path)
    if (p / checkpoint.META).is_file():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not root.is_dir():
        raise UsageError(f"--checkpoint {path}: no such folder")
    good, _ = checkpoint.newest_intact(root)
    if good is None:
        raise UsageError(f"--checkpoint {path}: holds no intact step-NNNNNN checkpoint")
    return good


def trajectory_record(t, advantage: float, tokenizer, step: int) -> dict:
    """One JSON-ready trajectory: text and tokens, mask, and each trained turn's logprobs."""
    logprobs = list(t.rollout_logprobs or [])
    turns, used = [], 0
    for span in t.turns:
        pairs = zip(t.token_ids[span.start : span.end], t.loss_mask[span.start : span.end])
        ids = [tok for tok, m in pairs if m]
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
        "seat": t.participant,
        "group": t.group,
        "reward": t.reward,
        "advantage": advantage,
        "status": t.status.value,
        "stop_reason": t.infos.get("stop_reason"),
        "messages": t.infos.get("messages", []),
        "text": tokenizer.decode(t.token_ids),
        "token_ids": t.token_ids,
        "loss_mask": t.loss_mask,
        "turns": turns,
    }


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv, description=__doc__.splitlines()[0], extra=(RolloutScriptConfig,))
        (script,) = args.extra
        out = Path(args.trainer.output_dir or "runs/rollouts")
        if (out / OUT_FILE).exists():
            raise UsageError(f"--output-dir {out}: already holds {OUT_FILE}")
        folder = checkpoint_folder(script.checkpoint) if script.checkpoint else None
        args, source = check(args)
    except UsageError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"rollout.py: error: {exc}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    distributed.init_distributed(timeout_s=args.trainer.collective_timeout_s)
    try:
        trainer = build_trainer(args, source)
        if folder is not None:
            trainer.backend.load(folder)
        records = []
        try:
            for step in range(args.trainer.steps):
                # user code in a local phase that ends at the world check, as in training
                rollout, _ = trainer.together("rollout", trainer.scored_rollout, step)
                records += [
                    trajectory_record(t, a, trainer.tokenizer, step)
                    for t, a in zip(rollout.trajectories, rollout.advantages.tolist(), strict=True)
                ]
        except distributed.WorldFailure as exc:  # on every rank: its last line names the cause
            print(f"rollout.py: error: {exc}", file=sys.stderr, flush=True)
            distributed.barrier_or_gone(trainer.world_check)
            return 1
        everything = [r for part in distributed.all_gather_object(records) for r in part]
        if distributed.rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            tmp = out / (OUT_FILE + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in everything))
            tmp.replace(out / OUT_FILE)
            print(f"wrote {len(everything)} trajectories to {out / OUT_FILE}", file=sys.stderr)
    finally:
        distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
