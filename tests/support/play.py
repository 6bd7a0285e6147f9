"""Playing task rows through co_step: one Policy per seat, each row a Conversation."""

from __future__ import annotations

from interlens_mcore.conversation import Conversation, Policy
from interlens_mcore.costep import co_step
from interlens_mcore.engine import Generation, SamplingParams
from interlens_mcore.stop import MaxTurns


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


class ScriptEngine:
    """Answers each conversation's turns with scripted texts (tokenized), in order."""

    name, max_context = "script", 1 << 15  # the tiny tokenizer spells a tools preamble out in ~4k tokens

    def __init__(self, tok, replies: dict[str, list[str]]):
        self.tok, self.replies, self.calls = tok, {k: list(v) for k, v in replies.items()}, 0

    def generate(self, requests):
        out = []
        for r in requests:
            text = self.replies[r.tag].pop(0)
            ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            out.append(Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"))
        return out


def scored(conv):
    """conv's trajectories with `infos["env_reward"]` set as the trainer sets it (sum over envs)."""
    from interlens_mcore.conversation import Environment

    out = []
    for t in conv.trajectories():
        scores = [p.reward_for(conv, t.participant) for p in conv.lineup if isinstance(p, Environment)]
        given = [s for s in scores if s is not None]
        t.infos["env_reward"] = float(sum(given)) if given else None
        out.append(t)
    return out
