"""Training agents written against the OpenAI API: `--agent MODULE:FN`, `AgentTasks`.

An agent is a function of a client and a row::

    async def solve(client, row):               # client: openai.AsyncOpenAI (OpenAI if FN is sync)
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": row["question"]}])
        return float(reply.choices[0].message.content.strip() == row["answer"])

It returns its reward: a number, or a dict with "reward" and optionally "success" (in [0, 1],
for `eval/success_rate`) and anything else to keep in the sample's infos. Returning None leaves
the sample to the reward functions (`--reward`). Each sample runs its agent once against its
own session of this rank's endpoint; the session's tokens are its trajectory (session.py), the
agents' calls are batched in lockstep rounds (rounds.py).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any, get_args

from ..engines.sampler import mix_seed
from ..rollout.rollouter import Rollout, Rollouter, RolloutPlan
from ..rollout.round import run_rounds
from ..tasks.base import TaskSource
from ..tasks.dataset import PromptRow
from ..types import Status, Trajectory, TrajectoryInfo, assemble
from .defaults import BRANCHES, REPLY_MATCH, ROUND_WAIT_S, Branches, ReplyMatch
from .rounds import AgentFn, AgentRounds, AgentRun, agent_call
from .server import AgentEndpoint
from .session import Session


def agent_row(row: object) -> object:
    """What an agent gets as its row: a dataset row's columns, any other row as it is."""
    return dict(row.columns) if isinstance(row, PromptRow) else row


def agent_result(value: object, where: str) -> dict[str, Any]:
    """An agent's return value as {"reward", "success", ...}; ValueError naming `where` otherwise."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        out: dict[str, Any] = {"reward": value}
    elif isinstance(value, bool):
        out = {"reward": float(value)}
    elif isinstance(value, Mapping):
        out = dict(value)
    else:
        raise ValueError(
            f"{where} returned {type(value).__name__}; expected a number (the reward) or a dict with 'reward'"
        )
    for key in ("reward", "success"):
        v = out.get(key)
        if v is None:
            continue
        try:
            number = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{where} returned {key}={v!r}; expected a number") from None
        if not math.isfinite(number) or (key == "success" and not 0 <= number <= 1):
            raise ValueError(
                f"{where} returned {key}={v!r}; expected a finite number"
                + (" in [0, 1]" if key == "success" else "")
            )
        out[key] = number
    return out


async def run_agents_async(
    plan: RolloutPlan[object],
    agent: AgentFn,
    *,
    max_batch_size: int | None = None,
    branches: Branches = BRANCHES,
    round_wait_s: float = ROUND_WAIT_S,
    reply_match: ReplyMatch = REPLY_MATCH,
    model: str = "policy",
) -> tuple[list[Trajectory], list[object], AgentRounds]:
    """Every sample of `plan` played by its agent (collective over the rollout group)."""
    import openai

    endpoint = AgentEndpoint(
        plan.engine,
        plan.tokenizer,
        sampling=plan.sampling,
        open_sessions=False,
        model=model,
        seed=plan.group_seed,
        reply_match=reply_match,
    )
    clients: list[Any] = []
    runs: list[AgentRun] = []
    name = getattr(agent, "__qualname__", type(agent).__name__)
    for sample in plan.samples:
        session = endpoint.open(sample.id, seed=mix_seed(plan.group_seed, sample.seed))

        def client_for(asynchronous: bool, _sid: str = sample.id) -> Any:
            # the endpoint is plain http on 127.0.0.1: an http client that loads no certificate
            # store (loading it took half the endpoint's time at 64 agents)
            options: dict[str, Any] = dict(
                base_url=endpoint.url(_sid), api_key="interlens", max_retries=0, timeout=None
            )
            client: Any
            if asynchronous:
                http = openai.DefaultAsyncHttpxClient(verify=False)
                client = openai.AsyncOpenAI(**options, http_client=http)
            else:
                client = openai.OpenAI(**options, http_client=openai.DefaultHttpxClient(verify=False))
            clients.append(client)
            return client

        call = agent_call(agent, client_for, agent_row(sample.row))
        where = f"agent {name} (sample {sample.id})"

        async def checked(_call: Any = call, _where: str = where) -> object:
            return agent_result(await _call(), _where)

        runs.append(AgentRun(session=session, start=checked))
    rounds = AgentRounds(
        plan.engine,
        runs,
        max_batch_size=max_batch_size,
        round_wait_s=round_wait_s,
        step_timeout_s=plan.step_timeout_s,
        on_sample_error=plan.on_sample_error,
    )
    endpoint.batcher = rounds
    await endpoint.start()
    try:
        await run_rounds(rounds, gather_fn=plan.gather_fn, rank=plan.rank)
    finally:
        rounds.cancel_all()
        await asyncio.gather(*(_close(c) for c in clients), return_exceptions=True)
        await endpoint.stop()
    trajectories, rows = [], []
    for run, sample in zip(runs, plan.samples, strict=True):
        filler = endpoint.chat.stop_token_ids[0]
        for t in session_trajectories(
            run.session, branches, group=sample.group, status=run.status, filler=filler
        ):
            info = t.infos
            info.conversation, info.index, info.seed = sample.id, sample.index, sample.seed
            info.stop_reason = run.reason
            result = run.result if isinstance(run.result, dict) else {}
            reward, success = result.get("reward"), result.get("success")
            info.env_reward = None if reward is None else float(reward)
            info.success = None if success is None else float(success)
            info.extra.update({k: v for k, v in result.items() if k not in ("reward", "success")})
            trajectories.append(t)
            rows.append(sample.row)
    return trajectories, rows, rounds


async def _close(client: Any) -> None:
    closed = client.close()
    if asyncio.iscoroutine(closed):
        await closed


def session_trajectories(
    session: Session, branches: Branches, *, group: int, status: Status, filler: int
) -> list[Trajectory]:
    """The session's trajectories (see session.py), with what records and rewards read. A
    session with no answered call is one untrained token (`filler`): the sample still counts
    in its group, with nothing to learn from."""
    if status is Status.STOPPED and session.truncated:
        status = Status.TRUNCATED
    stats = {
        "agent_calls": session.calls,
        "agent_branches": session.branches,
        "agent_departures": list(session.departures),
    }
    nodes = session.finals(branches)
    if not nodes:  # no call answered: nothing to train, the sample still counts in its group
        info = TrajectoryInfo(turns=0, extra=dict(stats))
        return [
            Trajectory(
                token_ids=[filler],
                loss_mask=[0],
                rollout_logprobs=None,
                group=group,
                status=status,
                infos=info,
            )
        ]
    out = []
    for node in nodes:
        messages = [dict(m) for m in node.messages or ()]
        replies = [str(m.get("content") or "") for m in messages if m.get("role") == "assistant"]
        info = TrajectoryInfo(
            turns=session.calls,
            messages=messages,
            completion=replies[-1] if replies else "",
            extra=dict(stats),
        )
        out.append(
            assemble(node.ids, node.turns, participant="policy", group=group, status=status, infos=info)
        )
    return out


def run_agents(plan: RolloutPlan[object], agent: AgentFn, **options: Any) -> Rollout:
    """`run_agents_async` from synchronous code (a task source's `run`)."""
    trajectories, rows, _ = asyncio.run(run_agents_async(plan, agent, **options))
    return Rollout(trajectories=trajectories, rows=rows)


class AgentTasks(TaskSource):
    """Rows of another source, each played by `agent` against this rank's endpoint.

    `rows` gives the rows (a `--dataset`, any TaskSource); the agent gets each as `agent_row`
    makes it. `branches`: train the session's last call's history, or every branch of it.
    """

    def __init__(
        self,
        agent: AgentFn,
        rows: TaskSource,
        *,
        name: str | None = None,
        branches: Branches = BRANCHES,
        round_wait_s: float = ROUND_WAIT_S,
        reply_match: ReplyMatch = REPLY_MATCH,
        success_threshold: float = 1.0,
    ):
        if branches not in get_args(Branches):
            raise ValueError(f"agent branches must be one of {get_args(Branches)}, got {branches!r}")
        if reply_match not in get_args(ReplyMatch):
            raise ValueError(f"agent reply match must be one of {get_args(ReplyMatch)}, got {reply_match!r}")
        if not (isinstance(round_wait_s, (int, float)) and round_wait_s > 0 and math.isfinite(round_wait_s)):
            raise ValueError(f"agent round wait must be a number of seconds > 0, got {round_wait_s!r}")
        self.agent, self.source = agent, rows
        self.name = name or f"agent-{getattr(agent, '__name__', 'fn')}"
        self.branches, self.round_wait_s, self.reply_match = branches, float(round_wait_s), reply_match
        self.success_threshold = success_threshold

    def rows(self, n: int, *, seed: int) -> Sequence[object]:
        return self.source.rows(n, seed=seed)

    def eval_rows(self, n: int, *, seed: int) -> Sequence[object]:
        return self.source.eval_rows(n, seed=seed)

    def _run(self, rollouter: Rollouter, plan: RolloutPlan[object]) -> Rollout:
        return run_agents(
            plan,
            self.agent,
            max_batch_size=rollouter.config.max_batch_size,
            branches=self.branches,
            round_wait_s=self.round_wait_s,
            reply_match=self.reply_match,
        )

    def run(self, rollouter: Rollouter, rows: Sequence[object], step: int) -> Rollout:
        return self._run(rollouter, rollouter.plan(rows, step))

    def evaluate(self, rollouter: Rollouter, rows: Sequence[object], step: int) -> Rollout:
        return self._run(rollouter, rollouter.plan(rows, step, evaluation=True))

    def success_of(self, trajectory: Trajectory) -> float | None:
        """What the agent said (`success`), else whether its reward reached `success_threshold`."""
        if trajectory.infos.success is not None:
            return trajectory.infos.success
        reward = trajectory.reward
        return None if reward is None else float(reward >= self.success_threshold)

    def option_defaults(self) -> dict[str, object]:
        return dict(self.source.option_defaults())

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "agent": getattr(self.agent, "__qualname__", repr(self.agent)),
            "rows": dict(self.source.describe()),
            "branches": self.branches,
            "reply_match": self.reply_match,
            "round_wait_s": self.round_wait_s,
        }
