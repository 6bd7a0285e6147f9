"""The supervised warm-up (`--sft-data`): masked next-token steps on demonstrations before GRPO.

A demonstration is one conversation in OpenAI message form, one JSON list a line. It is laid out
token for token as a rollout lays out the policy's view (`warm_start.transcript_ids`, the same
layout the default policy was built with), the assistant turns are the targets, everything
else is masked. Each step runs in the training backend (its forward gives the logprobs of the
targets, its backward and optimizer step apply the update), so the phase has the backend's
parallel layout (Megatron TP, DeepSpeed ZeRO, LoRA adapters) for free. The loss is the mean
negative logprob over the step's target tokens on every DP rank, divided by the global count
as the GRPO loss is.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from interlens_mcore import distributed
from interlens_mcore.assets.warm_start import transcript_ids
from interlens_mcore.chat import ChatFormat
from interlens_mcore.grpo.batch import TrainingBatch, build_batch
from interlens_mcore.types import Message, Trajectory

ROLES = ("system", "user", "assistant", "tool")
TRAINED_ROLE = "assistant"  # the trained seat's turns in a demonstration


class BadDemonstration(ValueError):
    """A line of an --sft-data file that is not a demonstration (the message names file and line)."""


def parse_demonstration(line: str, where: str) -> list[Message]:
    """One JSONL line as messages; BadDemonstration naming `where` (file:line) and what was expected."""
    expected = 'a JSON list of {"role": ..., "content": "..."} messages with at least one assistant turn'
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadDemonstration(f"{where}: not JSON ({exc.msg}); expected {expected}") from None
    if not isinstance(data, list) or not data:
        raise BadDemonstration(f"{where}: got {type(data).__name__}; expected {expected}")
    messages = []
    for i, m in enumerate(data):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise BadDemonstration(
                f"{where}: message {i} is {json.dumps(m)[:80]}; expected a role among {', '.join(ROLES)} "
                "and a string content"
            )
        messages.append(Message(speaker=m["role"], content=m["content"], role=m["role"]))
    if not any(m.role == TRAINED_ROLE for m in messages):
        raise BadDemonstration(f"{where}: no assistant turn to learn from; expected {expected}")
    if messages[0].role == TRAINED_ROLE:
        raise BadDemonstration(f"{where}: opens with an assistant turn, which has nothing to follow")
    return messages


def read_demonstrations(path: str | Path) -> list[list[Message]]:
    """Every non-empty line of a JSONL file as a demonstration (refused line by line)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise BadDemonstration(f"--sft-data {path}: unreadable ({exc.strerror})") from None
    demos = [parse_demonstration(s, f"{path}:{n}") for n, s in enumerate(lines, 1) if s.strip()]
    if not demos:
        raise BadDemonstration(f"--sft-data {path}: holds no demonstration; expected one JSON list a line")
    return demos


def demonstration_trajectories(chat: ChatFormat, demos: list[list[Message]]) -> list[Trajectory]:
    """Each demonstration as a trajectory: the rollout's token layout, 1 on the assistant's tokens."""
    out = []
    for messages in demos:
        ids, mask = transcript_ids(chat, messages)
        out.append(Trajectory(token_ids=ids, loss_mask=mask, rollout_logprobs=None))
    return out


def sft_loss(logprobs: torch.Tensor, batch: TrainingBatch, *, num_tokens: float) -> torch.Tensor:
    """Negative logprob of the target tokens summed, over the target tokens of every DP rank."""
    return -(logprobs * batch.loss_mask).sum() / max(num_tokens, 1.0)


@dataclass(frozen=True, kw_only=True)
class SupervisedPhase:
    """`steps` supervised optimizer steps of `batch_size` demonstrations per DP rank at `lr`."""

    trajectories: list[Trajectory]
    steps: int
    batch_size: int
    lr: float
    seed: int = 0

    def rows(self, step: int, dp_rank: int, count: int) -> list[Trajectory]:
        """The step's demonstrations on one DP rank: a pure function of (seed, step, rank), so a
        resumed phase draws what the cut one would have, and TP ranks of one DP rank agree."""
        rng = random.Random(f"{self.seed}:{step}:{dp_rank}")
        return [self.trajectories[rng.randrange(len(self.trajectories))] for _ in range(count)]

    def step(
        self, backend, groups: distributed.ParallelGroups, step: int, *, pad_id: int
    ) -> dict[str, float]:
        """One supervised optimizer step (collective); returns its `sft/` figures."""
        micro = backend.micro_batches or 1  # DeepSpeed steps after exactly this many backwards
        count = -(-max(self.batch_size, micro) // micro) * micro
        dp_rank = distributed.rank(groups.dp) if groups.dp_size > 1 else 0
        rows = self.rows(step, dp_rank, count)
        chunks = [rows[i::micro] for i in range(micro)]
        batches = [
            build_batch(
                c,
                [0.0] * len(c),
                layout=backend.layout,
                pad_to_multiple=backend.pad_to_multiple,
                pad_id=pad_id,
            )
            for c in chunks
        ]
        local = (
            torch.tensor([float(b.loss_mask.sum()) for b in batches], dtype=torch.float64).sum().reshape(1)
        )
        tokens = float(distributed.all_reduce(local, group=groups.dp)[0])
        backend.set_lr(self.lr)
        loss_sum = torch.zeros(1, dtype=torch.float64)
        for b in batches:
            loss = sft_loss(backend.logprobs_of(b), b, num_tokens=tokens)
            backend.backward(loss)
            loss_sum += loss.detach().double().cpu()
        grad_norm = backend.optimizer_step()
        mean = float(distributed.all_reduce(loss_sum, group=groups.dp)[0])
        return {"sft/loss": mean, "sft/tokens": tokens, "sft/grad_norm": float(grad_norm), "sft/lr": self.lr}

    def run(
        self,
        backend,
        groups: distributed.ParallelGroups,
        *,
        start: int,
        pad_id: int,
        log: Callable[[dict], None],
        save: Callable[[int], None],
        save_every: int,
    ) -> int:
        """Steps `start`.. of the phase (a resumed run continues where it was cut): `log(record)` after
        each, `save(done)` every `save_every` steps and after the last. Returns the steps done."""
        for done in range(start, self.steps):
            log({"sft_step": done, **self.step(backend, groups, done, pad_id=pad_id)})
            if (done + 1) % save_every == 0 or done + 1 == self.steps:
                save(done + 1)
        return self.steps
