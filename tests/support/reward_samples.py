"""Trajectories and rows as a `--dataset` rollout leaves them, for the reward tests."""

from __future__ import annotations

from interlens_mcore.tasks.dataset import PromptRow
from interlens_mcore.types import Message, Status, Trajectory, TrajectoryInfo, TurnSpan


def sample(
    completion: str, *, prompt: str = "What is 1/2 + 1/2?", ids: list[int] | None = None
) -> Trajectory:
    """A one-turn trajectory: 3 prompt tokens, then `ids` (default 4) sampled ones."""
    ids = [7, 8, 9, 10] if ids is None else ids
    messages = [
        {"role": "system", "name": "system", "content": "Think first."},
        {"role": "user", "name": "user", "content": prompt},
        {"role": "assistant", "name": "policy", "content": completion},
    ]
    return Trajectory(
        token_ids=[1, 2, 3, *ids],
        loss_mask=[0, 0, 0] + [1] * len(ids),
        rollout_logprobs=None,
        turns=[TurnSpan(start=3, end=3 + len(ids), speaker="policy", trained=True)],
        status=Status.STOPPED,
        infos=TrajectoryInfo(conversation=f"c-{completion[:8]}", completion=completion, messages=messages),
    )


def row(solution: object = "1", *, text: bool = False, **columns: object) -> PromptRow:
    prompt: object = "What is 1/2 + 1/2?" if text else [{"role": "user", "content": "What is 1/2 + 1/2?"}]
    return PromptRow(
        messages=[Message(speaker="user", content="What is 1/2 + 1/2?")],
        columns={"prompt": prompt, "solution": solution, **columns},
        text_prompt=text,
    )
