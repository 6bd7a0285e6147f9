"""The soak's ground truth and its checks: `Recorder` wraps the engine and logs every row it was
given and what it sampled; the checks hold each trajectory (and the packed training batch built
from them) against that recording."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from interlens_mcore import Conversation, HFEngine, Status, build_batch

# --- the engine, recorded ---------------------------------------------------------------------


@dataclass
class Call:
    """One row of one generate call: what the engine conditioned on and what it sampled."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]


class Recorder:
    """Forwards to the real engine; logs per request tag (conversation id, "request {i}")
    every row it was given and what it returned, in order. The ground truth of the checks."""

    def __init__(self, engine: HFEngine):
        self.engine, self.name, self.max_context = engine, engine.name, engine.max_context
        self.calls: dict[str, list[Call]] = defaultdict(list)
        self.generate_calls = 0
        self.before: Callable[[list[int]], None] | None = None  # sees the rows' turns first

    def reset(self, before: Callable[[list[int]], None] | None = None) -> None:
        self.calls.clear()
        self.generate_calls = 0
        self.before = before

    def generate(self, requests):
        if self.before is not None:  # may raise before this rank joins the lockstep forwards
            self.before([len(self.calls[r.tag]) + 1 for r in requests])
        out = self.engine.generate(requests)
        self.generate_calls += 1
        for r, g in zip(requests, out, strict=True):
            self.calls[r.tag].append(Call(list(r.prompt_ids), list(g.token_ids), list(g.logprobs)))
        return out


# --- checks against the recording -------------------------------------------------------------


def check_tokens(traj, sampled: list[tuple[int, int]], calls: list[Call]) -> list[str]:
    """Sampled ranges [s, e) of a trajectory against the engine's calls for it, in order."""
    ids, problems = traj.token_ids, []
    for k, ((s, e), call) in enumerate(zip(sampled, calls), 1):
        if ids[s:e] != call.token_ids:
            problems.append(f"turn {k}: trained ids {ids[s:e]} != engine's {call.token_ids}")
        if ids[:s] != call.prompt_ids:  # token-space exactness: what the engine conditioned on
            problems.append(
                f"turn {k}: trajectory prefix ({s} ids) != engine prompt ({len(call.prompt_ids)})"
            )
    mask = [0] * len(ids)
    for s, e in sampled:
        mask[s:e] = [1] * (e - s)
    if traj.loss_mask != mask:
        problems.append("loss mask is not 1 exactly on the sampled ids")
    logprobs = [x for call in calls[: len(sampled)] for x in call.logprobs]
    complete = len(logprobs) == sum(mask)  # the completeness rule
    if traj.rollout_logprobs != (logprobs if complete else None):
        problems.append(f"rollout logprobs differ from the engine's (complete={complete})")
    return problems


def check_conversation(conv: Conversation, traj, calls: list[Call], commits: Counter) -> list[str]:
    policy = conv.lineup[0]
    opener = policy.chat.generation_prompt_ids()
    sampled = [(span.start + len(opener), span.end) for span in traj.turns]
    problems = check_tokens(traj, sampled, calls)
    for k, span in enumerate(traj.turns, 1):
        if traj.token_ids[span.start : span.start + len(opener)] != opener:
            problems.append(f"turn {k}: span does not start with the assistant opener")
    if not len(traj.turns) == len(calls) == commits["policy"]:
        problems.append(
            f"{len(traj.turns)} trained turns, {len(calls)} engine calls, {commits['policy']} commits"
        )
    if not traj.infos["turns"] == conv.turns_taken == sum(commits.values()):
        problems.append(
            f"infos turns {traj.infos['turns']}, turns_taken {conv.turns_taken}, commits {commits}"
        )
    if traj.status != conv.status or traj.infos["conversation"] != conv.id:
        problems.append("trajectory status or conversation id differ from the conversation's")
    return problems


def check_output(out, traj, calls: list[Call]) -> list[str]:
    sampled = [(span.start, span.end) for span in traj.turns]
    problems = check_tokens(traj, sampled, calls)
    # a request that failed in its hook or step made the engine call but keeps no turn for it
    unrecorded = 1 if out.status is Status.FAILED else 0
    if not len(sampled) == out.num_turns == len(calls) - unrecorded:
        problems.append(f"{len(sampled)} trained turns, num_turns {out.num_turns}, {len(calls)} engine calls")
    if not all(span.trained for span in traj.turns):
        problems.append("an untrained response span")
    return problems


def check_batch(trajs: list) -> list[str]:
    """The packed training tensors: targets at loss positions are the sampled ids, the old
    logprobs sit on the same positions in the same order."""
    trainable = [t for t in trajs if sum(t.loss_mask)]
    if not trainable:
        return []
    try:
        batch = build_batch(trainable, torch.zeros(len(trainable)), layout="packed", pad_to_multiple=8)
    except ValueError as exc:
        return [f"build_batch: {exc}"]
    problems = []
    for i, t in enumerate(trainable):
        a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        ids = torch.tensor(t.token_ids)  # [L]
        want_mask = torch.tensor(t.loss_mask[1:] + [0], dtype=torch.bool)  # position p predicts p + 1
        mask = batch.loss_mask[0, a:b]
        if not torch.equal(mask, want_mask):
            problems.append(f"batch sample {i}: loss positions differ from the mask shifted by one")
            continue
        if not torch.equal(batch.targets[0, a:b][mask], ids[1:][want_mask[:-1]]):
            problems.append(f"batch sample {i}: targets at loss positions are not the sampled ids")
        old = batch.rollout_logprobs[0, a:b][mask]
        want = torch.tensor(t.rollout_logprobs or [0.0] * int(mask.sum()), dtype=torch.float32)
        if not torch.equal(old, want) or bool(batch.logprobs_complete[i]) != t.logprobs_complete:
            problems.append(f"batch sample {i}: old logprobs do not line up with the trajectory's")
    return problems
