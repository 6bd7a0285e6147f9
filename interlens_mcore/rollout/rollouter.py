"""`Rollouter`: a step's rows in, trajectories ready to score out (collective over the rollout group).

Each row becomes `num_generations` samples on this rank. A row that lays out a lineup (a
`Task`) runs through `co_step`; rows of a task source with a `MultiTurnScheduler` run through
`run_multi_turn`. Either way every trajectory leaves with what scoring needs in `infos`:
`env_reward` (the environments' or the scheduler's own reward for its seat), `completion`
(the seat's last message), `messages` (the transcript as the seat saw it) and, where the task
reports one, `success`.

Sampling seeds depend only on (seed, step, rank, row, sample), so a resumed run replays the
same samples.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..engines.base import Engine, SamplingParams
from ..engines.sampler import mix_seed
from ..grpo.advantages import group_advantages
from ..grpo.batch import Layout, TrainingBatch, build_batch
from ..types import Status, Trajectory
from .conversation import Conversation, Environment, Policy
from .costep import co_step
from .limits import check_time_limit
from .multiturn import EngineRollout, MultiTurnRequest, MultiTurnScheduler, prepare_requests, run_multi_turn
from .stop import MaxTurns

_EVAL_SALT = 0x6576616C  # folded into evaluation seeds, so they never repeat a training step's


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How rollouts are sampled, grouped and cut into micro-batches."""

    num_generations: int = field(default=16, metadata={"help": "samples per prompt: one advantage group"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of every policy turn"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1: off)"})
    top_k: int = field(default=0, metadata={"help": "sample among the k most likely tokens (0: off)"})
    min_p: float = field(
        default=0.0, metadata={"help": "drop tokens below this fraction of the top one's probability"}
    )
    repetition_penalty: float = field(default=1.0, metadata={"help": "> 1 discourages tokens already seen"})
    presence_penalty: float = field(
        default=0.0, metadata={"help": "subtracted once per token already sampled"}
    )
    frequency_penalty: float = field(
        default=0.0, metadata={"help": "subtracted per occurrence in the output"}
    )
    stop: list[str] = field(
        default_factory=list, metadata={"help": "strings that end a policy turn (kept in the turn)"}
    )
    max_new_tokens: int = field(default=6, metadata={"help": "token cap of one policy turn"})
    max_batch_size: int | None = field(
        default=None, metadata={"help": "rows per engine call (default: all of a round's rows)"}
    )
    scale_by_std: bool = field(default=True, metadata={"help": "divide advantages by the group's std"})
    leave_one_out: bool = field(
        default=False, metadata={"help": "baseline = mean of the other samples (RLOO)"}
    )
    drop_zero_variance: bool = field(
        default=False, metadata={"help": "leave out groups whose rewards are all equal"}
    )
    micro_batch_size: int = field(
        default=0, metadata={"help": "trajectories per forward/backward (0: all of a rank's)"}
    )
    seed: int = field(
        default=0, metadata={"help": "seeds the rows of every step and every sample's sampling"}
    )
    step_timeout_s: float | None = field(
        default=None, metadata={"help": "time limit of one environment / tool / scheduler step, seconds"}
    )
    on_timeout: Literal["zero", "drop"] = field(
        default="zero", metadata={"help": "a timed-out sample scores 0 (zero) or leaves the batch (drop)"}
    )

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError(f"RolloutConfig.num_generations must be >= 1, got {self.num_generations}")
        if self.micro_batch_size < 0:
            raise ValueError(f"RolloutConfig.micro_batch_size must be >= 0, got {self.micro_batch_size}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"RolloutConfig.max_batch_size must be >= 1, got {self.max_batch_size}")
        check_time_limit(self.step_timeout_s, "RolloutConfig.step_timeout_s")
        if self.on_timeout not in ("zero", "drop"):
            raise ValueError(
                f"RolloutConfig.on_timeout must be one of ('zero', 'drop'), got {self.on_timeout!r}"
            )
        _ = self.sampling  # SamplingParams validates temperature and max_new_tokens

    @property
    def sampling(self) -> SamplingParams:
        """The sampling settings of every policy turn (logprobs are under what they sample from)."""
        return SamplingParams(
            temperature=self.temperature,
            max_new_tokens=self.max_new_tokens,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=tuple(self.stop),
        )


@dataclass
class Rollout:
    """One step's rollouts on this rank (after scoring: rewards, advantages, keep)."""

    trajectories: list[Trajectory]  # [N] in (row, generation, seat) order
    rows: list[Any]  # [N] the row each trajectory came from
    advantages: torch.Tensor | None = None  # [N] float32
    keep: torch.Tensor | None = None  # [N] bool: False for dropped groups and dropped timeouts
    conversations: list[Conversation] = field(default_factory=list)  # this rank's; empty for schedulers

    @property
    def rewards(self) -> torch.Tensor:
        return torch.tensor([t.reward for t in self.trajectories], dtype=torch.float32)  # [N]

    @property
    def timeouts(self) -> int:
        """Samples whose conversation a step time limit ended (scored or dropped per config)."""
        return sum(t.status is Status.TIMEOUT for t in self.trajectories)

    @property
    def truncated(self) -> int:
        """Samples whose conversation outgrew the engine's context (earlier turns kept)."""
        return sum(t.status is Status.TRUNCATED for t in self.trajectories)

    def scored_rewards(self) -> list[float]:
        """Every trajectory's reward, in order (a ValueError if one is not scored)."""
        return [_reward(t) for t in self.trajectories]

    def seat_rewards(self) -> dict[str, list[float]]:
        """Rewards per trained seat (participant name), in trajectory order."""
        out: dict[str, list[float]] = {}
        for t in self.trajectories:
            out.setdefault(t.participant, []).append(_reward(t))
        return out


class Rollouter:
    """Runs rows through the drivers on this rank's part of the rollout group.

    `frozen_engine` builds (once, on first use) the engine of seats named in `frozen_seats`:
    a frozen copy of the initial weights that plays but never trains.
    """

    def __init__(
        self,
        *,
        engine: Engine,
        tokenizer: Any,
        groups: Any,
        config: RolloutConfig,
        frozen_seats: Sequence[str] = (),
        frozen_engine: Callable[[], Engine] | None = None,
        stop: Sequence[str] = (),
    ):
        if frozen_seats and frozen_engine is None:
            raise ValueError(f"frozen seats {list(frozen_seats)} need a frozen_engine (the backend's)")
        self.engine, self.tokenizer, self.groups, self.config = engine, tokenizer, groups, config
        self.frozen_seats, self._frozen_engine_fn = tuple(frozen_seats), frozen_engine
        self._policies: dict[tuple[str, bool], Policy] = {}
        # the task's own stop strings (a tool call's closing tag) join the configured ones
        sampling = config.sampling
        self.sampling = dataclasses.replace(sampling, stop=tuple(dict.fromkeys([*sampling.stop, *stop])))

    # -- seats ----------------------------------------------------------------------------------
    def trained(self, name: str) -> Policy:
        """The trained policy in seat `name` (built once per seat: a chat format renders probes)."""
        return self._policy(name, frozen=False)

    def seat(self, name: str) -> Policy:
        """Who plays seat `name` in training: the frozen copy for a frozen seat, else the trained one."""
        return self._policy(name, frozen=name in self.frozen_seats)

    def _policy(self, name: str, *, frozen: bool) -> Policy:
        if (name, frozen) not in self._policies:
            engine = self._frozen_engine() if frozen else self.engine
            self._policies[name, frozen] = Policy(
                name=name,
                engine=engine,
                tokenizer=self.tokenizer,
                sampling=self.sampling,
                trainable=not frozen,
            )
        return self._policies[name, frozen]

    def engines(self) -> list[Engine]:
        """Every engine a lineup may use: a rank holding none of a frozen seat still joins its calls."""
        return [self.engine, self._frozen_engine()] if self.frozen_seats else [self.engine]

    def _frozen_engine(self) -> Engine:
        assert self._frozen_engine_fn is not None, "__init__ refuses frozen seats without a frozen_engine"
        return self._frozen_engine_fn()

    # -- the step ---------------------------------------------------------------------------------
    def run(
        self,
        rows: Sequence[Any],
        step: int,
        scheduler: MultiTurnScheduler | None = None,
        *,
        reward_key: str = "reward",
    ) -> Rollout:
        """`num_generations` samples of every row (collective over the rollout group).

        With a scheduler, rows are message lists or dicts with a "messages" key (their other
        fields reach the scheduler in `request.data`), and `rollout_infos[reward_key]` is the
        environment reward.
        """
        if scheduler is not None:
            return self._scheduled(scheduler, rows, step, reward_key)
        rank, n = self.groups.rank, self.config.num_generations
        convs, conv_rows = [], []
        for i, row in enumerate(rows):
            for k in range(n):
                seed = mix_seed(self.config.seed, step, rank, i, k)
                convs.append(_conversation(row, self.seat, f"s{step}-r{rank}-p{i}-g{k}", seed, i))
                conv_rows.append(row)
        return self._lineups(convs, conv_rows, mix_seed(self.config.seed, step))

    def evaluate(self, rows: Sequence[Any], step: int) -> Rollout:
        """Each row played once, the trained policy in every policy seat (collective).

        Also a seat a frozen opponent holds in training: evaluation measures what training
        changes. Seeds differ from every training step's.
        """
        rank = self.groups.rank
        convs = [
            _conversation(
                row,
                self.trained,
                f"eval{step}-r{rank}-p{i}",
                mix_seed(self.config.seed, step, rank, i, _EVAL_SALT),
                i,
            )
            for i, row in enumerate(rows)
        ]
        return self._lineups(convs, list(rows), mix_seed(self.config.seed, step, _EVAL_SALT))

    def _lineups(self, convs: list[Conversation], conv_rows: list[Any], group_seed: int) -> Rollout:
        co_step(
            convs,
            turns=None,
            max_batch_size=self.config.max_batch_size,
            group_seed=group_seed,
            gather_fn=self.groups.gather_fn(),
            rank=self.groups.rank,  # the global rank: what a failure's message names
            engines=self.engines(),
            step_timeout_s=self.config.step_timeout_s,
        )
        trajectories, rows = [], []
        for conv, row in zip(convs, conv_rows, strict=True):
            for t in conv.trajectories():
                describe(t, conv)
                trajectories.append(t)
                rows.append(row)
        return Rollout(trajectories=trajectories, rows=rows, conversations=convs)

    def _scheduled(
        self, scheduler: MultiTurnScheduler, rows: Sequence[Any], step: int, reward_key: str
    ) -> Rollout:
        cfg, chat = self.config, self.trained("policy").chat
        requests, req_rows, n = [], [], cfg.num_generations
        for i, row in enumerate(rows):
            messages, data = (row["messages"], row) if isinstance(row, dict) else (row, {})
            extra = {k: v for k, v in data.items() if k != "messages"}
            for k in range(n):
                index = (self.groups.rank * len(rows) + i) * n + k
                requests.append(
                    MultiTurnRequest.from_messages(chat, messages, index=index, data={**extra, "group": i})
                )
                req_rows.append(row)
        rollout_fn = EngineRollout(self.engine, chat, seed=mix_seed(cfg.seed, step))
        requests = prepare_requests(scheduler, requests)  # the scheduler's before_first_turn
        first = rollout_fn(requests, self.sampling)  # collective: every rank has rows every step
        outputs = run_multi_turn(
            requests,
            first,
            scheduler,
            rollout_fn,
            self.sampling,
            gather_fn=self.groups.gather_fn(),
            rank=self.groups.rank,
            step_timeout_s=cfg.step_timeout_s,
        )
        trajectories = []
        for o in outputs:
            t = o.to_trajectory(group=o.request.data["group"])
            t.infos["env_reward"] = t.infos.get(reward_key)
            t.infos["turns"] = o.num_turns
            replies = [m["content"] for m in o.request.messages if m.get("role") == "assistant"]
            t.infos["completion"] = replies[-1] if replies else ""
            t.infos["messages"] = list(o.request.messages)
            trajectories.append(t)
        return Rollout(trajectories=trajectories, rows=req_rows)


def _conversation(row: Any, seat: Callable[[str], Policy], cid: str, seed: int, group: int) -> Conversation:
    """One sample of a lineup row: its seats filled by `seat`, its turn cap, its own seed."""
    return Conversation(
        row.lineup(seat),
        prompt=row.prompt(),
        run_until=MaxTurns(row.max_turns),
        id=cid,
        seed=seed,
        group=group,
    )


def describe(t: Trajectory, conv: Conversation) -> None:
    """Fill `t.infos` with what reward functions and records read (see the module docstring)."""
    seat = t.participant
    given = [p.reward_for(conv, seat) for p in conv.lineup if isinstance(p, Environment)]
    scores = [s for s in given if s is not None]
    t.infos["env_reward"] = float(sum(scores)) if scores else None
    own = [m.content for m in conv.messages if m.speaker == seat]
    t.infos["completion"] = own[-1] if own else ""
    t.infos["messages"] = [
        {"role": "assistant" if m.speaker == seat else m.role, "name": m.speaker, "content": m.content}
        for m in conv.messages
    ]
    outcome = conv.infos.get("outcome")
    if isinstance(outcome, dict) and seat in outcome:
        t.infos["success"] = float(outcome[seat])
    elif conv.infos.get("success") is not None:
        t.infos["success"] = float(conv.infos["success"])


def rollout_advantages(
    trajectories: Sequence[Trajectory], config: RolloutConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages [N] and keep [N] per (prompt, seat) group; timed-out samples scored 0 or left out.

    Rewards must be set. A dropped sample must not move its group's baseline, so advantages are
    computed over the others only.
    """
    timed_out = [t.status is Status.TIMEOUT for t in trajectories]
    if config.on_timeout == "zero":
        for t, late in zip(trajectories, timed_out, strict=True):
            t.reward = 0.0 if late else t.reward
    seats = sorted({t.participant for t in trajectories})
    key = [t.group * len(seats) + seats.index(t.participant) for t in trajectories]  # (prompt, seat)
    used = [i for i, late in enumerate(timed_out) if not (late and config.on_timeout == "drop")]
    if config.leave_one_out:  # a sample its group's drops left alone has no baseline: it leaves too
        full = {k: key.count(k) for k in set(key)}
        left = {k: sum(key[i] == k for i in used) for k in set(key)}
        used = [i for i in used if left[key[i]] > 1 or full[key[i]] == 1]
    adv = torch.zeros(len(trajectories))
    keep = torch.zeros(len(trajectories), dtype=torch.bool)
    if used:
        a, k = group_advantages(
            [_reward(trajectories[i]) for i in used],
            [key[i] for i in used],
            scale_by_std=config.scale_by_std,
            leave_one_out=config.leave_one_out,
            drop_zero_variance=config.drop_zero_variance,
        )
        adv[used], keep[used] = a, k
    return adv, keep


def _reward(t: Trajectory) -> float:
    if t.reward is None:
        raise ValueError(
            f"a trajectory of group {t.group} (seat {t.participant!r}) has no reward; score every one first"
        )
    return float(t.reward)


def micro_batches(
    rollout: Rollout, *, micro_batch_size: int, layout: Layout, pad_to_multiple: int, pad_id: int
) -> list[TrainingBatch | None]:
    """Micro-batches of the kept trajectories; trajectories with no trained token are skipped.

    The number of micro-batches depends only on the config and the number of trajectories, so
    every DP rank makes the same number of forward/backward calls (None marks an empty one: the
    caller still joins the collectives with a zero-token batch of its own).
    """
    if rollout.advantages is None or rollout.keep is None:
        raise ValueError("micro_batches needs a scored rollout: set its advantages and keep first")
    pairs = [
        (t, float(a))
        for t, a, k in zip(rollout.trajectories, rollout.advantages, rollout.keep, strict=True)
        if k and t.num_trained_tokens > 0
    ]
    size = micro_batch_size or max(1, len(rollout.trajectories))
    count = math.ceil(len(rollout.trajectories) / size)
    chunks = [pairs[i * size : (i + 1) * size] for i in range(count)]
    return [
        build_batch(
            [t for t, _ in c],
            [a for _, a in c],
            layout=layout,
            pad_to_multiple=pad_to_multiple,
            pad_id=pad_id,
        )
        if c
        else None
        for c in chunks
    ]
