"""What a step's figures read of each sample, in one place, and the figures made from it.

`facts_of(trajectory, reward, dataset)` is the only reader of `Trajectory.infos` among the step
figures: the counters tasks and tools leave there (`invalid_moves` from textarena,
`invalid_actions` from gymnasium, `tool_calls` / `tool_valid_calls` / `tool_errors` from a
`ToolEnvironment`, `agent_calls` / `agent_branches` from an `--agent` session) become typed
fields. `sample_figures` turns every rank's facts into the per-step metrics: completion lengths
and the share cut at the token cap, groups with zero reward variance, invalid moves and actions,
tool calls, an agent's endpoint calls and history branches, and the reward per dataset of a task
mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from interlens_mcore.tools import TOOL_COUNTERS, tool_metrics
from interlens_mcore.types import Status, Trajectory


@dataclass(frozen=True, kw_only=True)
class SampleFacts:
    """One scored trajectory, as the step figures see it."""

    seat: str
    group: int  # prompt index on its rank: (rank, group, seat) is one advantage group
    reward: float
    success: float | None  # None: the task does not say
    win: float | None  # the seat's outcome of a multi-seat game: 1 win, 1/2 tie, 0 loss
    turns: int  # turns of the whole conversation
    status: Status
    completion_tokens: int  # tokens the seat sampled in its trained turns
    replies: int  # the seat's trained replies
    replies_cut: int  # of them, those that ended at their token cap (finish reason "length")
    invalid: int | None  # invalid moves / actions the task counted (None: the task counts none)
    ended_invalid: bool  # invalid moves or actions ended it (see `facts_of`)
    # the ToolEnvironment's counters (`TOOL_COUNTERS`) and the turns, as `tool_metrics` reads
    # them; None: no tools were offered
    tools: dict[str, int] | None
    dataset: str | None  # the dataset of a task mix the sample's row came from
    # an --agent session's endpoint calls and the branches its history rewrites opened (None: no agent)
    agent: tuple[int, int] | None = None
    judge_unparsed: int | None = None  # 1: --judge-model's reply held no score (None: no judge)


def _count(value: object) -> int | None:
    """An environment's counter (`invalid_moves`, `tool_calls`...), None when it set none."""
    return int(value) if isinstance(value, int | float) else None


def facts_of(t: Trajectory, reward: float, dataset: str | None = None) -> SampleFacts:
    """The facts of trajectory `t`, scored `reward`, whose row names `dataset` (of a mix).

    A sample counts as ended by invalid moves when a move the game rejected ended it (textarena
    ends a game at the first one), or when none of its actions was valid (a gymnasium episode
    that ran out of steps on invalid replies).
    """
    info = t.infos
    moves, actions = _count(info.get("invalid_moves")), _count(info.get("invalid_actions"))
    counted = [n for n in (moves, actions) if n is not None]
    steps = _count(info.get("steps")) or 0
    ended = bool(moves) or (actions is not None and steps > 0 and actions >= steps)
    tools = None
    if "tool_calls" in info:  # a ToolEnvironment set its counters: tools were offered
        tools = {k: _count(info.get(k)) or 0 for k in (*TOOL_COUNTERS, "turns")}
    calls = _count(info.get("agent_calls"))
    agent = None if calls is None else (calls, _count(info.get("agent_branches")) or 0)
    success, outcome = info.success, info.outcome
    win = float(outcome[t.participant]) if outcome is not None and t.participant in outcome else None
    return SampleFacts(
        seat=t.participant,
        group=t.group,
        reward=float(reward),
        success=None if success is None else float(success),
        win=win,
        turns=info.turns,
        status=t.status,
        completion_tokens=t.num_trained_tokens,
        replies=len(t.turns),
        replies_cut=sum(span.finish_reason == "length" for span in t.turns),
        invalid=sum(counted) if counted else None,
        ended_invalid=ended,
        tools=tools,
        dataset=dataset,
        agent=agent,
        judge_unparsed=_count(info.get("judge_unparsed")),
    )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def zero_std_fraction(parts: Sequence[Sequence[SampleFacts]]) -> float:
    """Share of advantage groups (rank, prompt, seat) whose rewards are all equal: no signal.

    `parts[r]` holds rank r's samples; a group's samples never span two ranks.
    """
    groups: dict[tuple[int, int, str], list[float]] = {}
    for rank, part in enumerate(parts):
        for f in part:
            groups.setdefault((rank, f.group, f.seat), []).append(f.reward)
    if not groups:
        return 0.0
    return sum(max(r) == min(r) for r in groups.values()) / len(groups)


def sample_figures(parts: Sequence[Sequence[SampleFacts]]) -> dict[str, float]:
    """Every rank's facts (`parts[r]`: rank r's samples) as the step's sample metrics."""
    facts = [f for part in parts for f in part]
    if not facts:
        return {}
    lengths = [f.completion_tokens for f in facts]
    replies = sum(f.replies for f in facts)
    out: dict[str, float] = {
        "completions/mean_length": _mean(lengths),
        "completions/min_length": min(lengths),
        "completions/max_length": max(lengths),
        "completions/clipped_ratio": sum(f.replies_cut for f in facts) / replies if replies else 0.0,
        "frac_reward_zero_std": zero_std_fraction(parts),
        "truncated_fraction": _mean([f.status is Status.TRUNCATED for f in facts]),
    }
    invalid = [f for f in facts if f.invalid is not None]
    if invalid:  # the task counts invalid moves or actions
        out["invalid/per_sample"] = _mean([f.invalid or 0 for f in invalid])
        out["invalid/ended_fraction"] = _mean([f.ended_invalid for f in invalid])
    # tool/calls_per_sample, tool/valid_fraction, tool/errors_per_sample, turns_per_sample
    out.update(tool_metrics([f.tools for f in facts if f.tools is not None]))
    agents = [f.agent for f in facts if f.agent is not None]
    if agents:  # --agent: what the agents asked of the endpoint
        out["agent/calls_per_sample"] = _mean([c for c, _ in agents])
        out["agent/branches_per_sample"] = _mean([b for _, b in agents])
    out.update(dataset_rewards(facts))
    return out


def dataset_rewards(facts: Sequence[SampleFacts]) -> dict[str, float]:
    """`reward_mean/dataset/<name>` per dataset of a task mix (samples that name their dataset)."""
    by_name: dict[str, list[float]] = {}
    for f in facts:
        if f.dataset is not None:
            by_name.setdefault(f.dataset, []).append(f.reward)
    return {f"reward_mean/dataset/{name}": _mean(v) for name, v in sorted(by_name.items())}
