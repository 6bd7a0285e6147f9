"""Playing task rows through co_step: one Policy per seat, each row a Conversation."""

from __future__ import annotations

from dataclasses import replace

from interlens_mcore.engines.base import SamplingParams
from interlens_mcore.rollout.conversation import Conversation, Policy
from interlens_mcore.rollout.costep import co_step
from interlens_mcore.rollout.stop import MaxTurns

from .fakes import ScriptEngine


def play(rows, engine, tok, *, max_new_tokens=8, seed=0, step_timeout_s=None):
    """Conversations of `rows` played with `engine` in every policy seat (greedy-free sampling)."""
    seats: dict[str, Policy] = {}
    if isinstance(engine, ScriptEngine):  # its scripted replies must fit the turn's token cap
        max_new_tokens = max(max_new_tokens, 512)

    def seat(name: str) -> Policy:
        if name not in seats:
            seats[name] = Policy(name, engine, tok, SamplingParams(max_new_tokens=max_new_tokens))
        return seats[name]

    convs = [
        Conversation(r.lineup(seat), prompt=r.prompt(), run_until=MaxTurns(r.max_turns), id=f"row{i}")
        for i, r in enumerate(rows)
    ]
    co_step(convs, group_seed=seed, step_timeout_s=step_timeout_s)
    return convs


def scored(conv):
    """conv's trajectories with `infos["env_reward"]` set as the trainer sets it (sum over envs)."""
    from interlens_mcore.rollout.conversation import Environment

    out = []
    for t in conv.trajectories():
        scores = [p.reward_for(conv, t.participant) for p in conv.lineup if isinstance(p, Environment)]
        given = [s for s in scores if s is not None]
        t.infos["env_reward"] = float(sum(given)) if given else None
        out.append(t)
    return out


def engine_turns(engine, reqs: list, turns: int = 3) -> list[list]:
    """`turns` calls where each row's next prompt is its last prompt, its reply and two new
    tokens (another speaker's message): what co_step asks of an engine, tags kept."""
    out = []
    for turn in range(turns):
        gens = engine.generate(reqs)
        out.append(gens)
        reqs = [
            replace(
                r,
                prompt_ids=[*r.prompt_ids, *g.token_ids, 50 + turn, 60 + r.seed % 7],
                seed=r.seed + 1000,
            )
            for r, g in zip(reqs, gens, strict=True)
        ]
    return out
