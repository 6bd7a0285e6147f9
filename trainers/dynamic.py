"""Dynamic sampling: a step's batch refilled with prompts whose samples disagree.

A prompt whose samples all got the same reward gives every one of them advantage 0: it costs a
rollout and teaches nothing. With `--dynamic-sampling` the step rolls out more prompts (each an
extra round, fresh rows, as many as the first) until every rank has `batch_size /
num_generations` informative prompts or `--max-extra-rounds` rounds were added; verl calls this
`filter_groups`, ms-swift `dynamic_sample`. Every rank takes part in every extra round (the
rounds are collective), and the number of rounds is agreed by a max over the world of each
rank's shortfall, so ranks never disagree on it. A rank already full draws its round's rows too
and keeps the ones it needs least; when the cap is reached short, the batch is filled up with the
first round's uninformative prompts (they train nothing, as without dynamic sampling), so a
step's batch keeps its size.

`refill` is the pure part: which prompts of which rounds make the step's batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from interlens_mcore.rollout.rollouter import Rollout
from interlens_mcore.types import Status

Components = dict[str, list[float | None]]


def prompt_spans(rollout: Rollout) -> list[list[int]]:
    """The trajectory indices of each prompt, in order (a prompt's trajectories are consecutive
    in a rollout: (row, generation, seat) order; `Trajectory.group` names the prompt)."""
    spans: list[list[int]] = []
    last: int | None = None
    for i, t in enumerate(rollout.trajectories):
        if t.group != last:
            spans.append([])
            last = t.group
        spans[-1].append(i)
    return spans


def informative(rollout: Rollout, span: Sequence[int]) -> bool:
    """Whether a prompt's samples teach anything: two of its kept, scored, not failed samples
    of one seat got different rewards."""
    assert rollout.keep is not None, "informative needs a scored rollout"
    by_seat: dict[str, set[float]] = {}
    for i in span:
        t = rollout.trajectories[i]
        if bool(rollout.keep[i]) and t.status is not Status.FAILED and t.reward is not None:
            by_seat.setdefault(t.participant, set()).add(float(t.reward))
    return any(len(rewards) > 1 for rewards in by_seat.values())


def shortfall(rounds: Sequence[Rollout], quota: int) -> int:
    """Informative prompts this rank still lacks for a batch of `quota` prompts."""
    found = sum(informative(r, s) for r in rounds for s in prompt_spans(r))
    return max(quota - found, 0)


def refill(rounds: Sequence[tuple[Rollout, Components]], quota: int) -> tuple[Rollout, Components, int]:
    """The step's batch of `quota` prompts out of the rounds' rollouts, its reward components,
    and how many of its prompts are informative.

    Informative prompts first, in round order; then, if too few, the first round's other
    prompts in order. Prompts are renumbered 0..quota-1 (`Trajectory.group`), so prompts of
    different rounds never share an advantage group; their advantages were computed within
    their own round, where each prompt's samples all are.
    """
    chosen: list[tuple[int, list[int]]] = []  # (round, trajectory indices)
    for k, (rollout, _) in enumerate(rounds):
        chosen += [(k, s) for s in prompt_spans(rollout) if informative(rollout, s)]
    chosen = chosen[:quota]
    kept = len(chosen)
    first = rounds[0][0]
    taken = {tuple(s) for k, s in chosen if k == 0}
    filler = [(0, s) for s in prompt_spans(first) if tuple(s) not in taken]
    chosen += filler[: quota - len(chosen)]
    trajectories, rows, advantages, keep = [], [], [], []
    components: Components = {name: [] for name in rounds[0][1]}
    for new_group, (k, span) in enumerate(chosen):
        rollout, parts = rounds[k]
        assert rollout.advantages is not None and rollout.keep is not None
        for i in span:
            t = rollout.trajectories[i]
            t.group = new_group
            trajectories.append(t)
            rows.append(rollout.rows[i])
            advantages.append(rollout.advantages[i])
            keep.append(rollout.keep[i])
        for name, values in parts.items():
            components.setdefault(name, []).extend(values[i] for i in span)
    conversations = [c for r, _ in rounds for c in r.conversations]
    batch = Rollout(
        trajectories=trajectories,
        rows=rows,
        advantages=torch.stack(advantages) if advantages else torch.zeros(0),
        keep=torch.stack(keep) if keep else torch.zeros(0, dtype=torch.bool),
        conversations=conversations,
        batch_step=first.batch_step,  # every round's is the same: one config
    )
    return batch, components, kept
