"""`Rollouter`: a step's rows in, trajectories ready to score out (collective over the rollout group).

Each row becomes `num_generations` samples on this rank. A row that lays out a lineup (a
`Task`) runs through `co_step`; rows of a task source with a `MultiTurnScheduler` run through
`run_multi_turn`. Either way every trajectory leaves with what scoring needs in `infos`:
`env_reward` (the environments' or the scheduler's own reward for its seat), `completion`
(the seat's last message), `messages` (the whole transcript as the seat saw it: the row's
opening messages, then the conversation; `opening` says how many open it) and, where the task
reports one, `success`. What reward functions read of these is built in one place,
`rewards.inputs.reward_inputs`.

Every path expands rows the same way (`expand_rows`): a sample's group, index, id and seed
depend only on (seed, step, rank, row, sample), so a resumed run replays the same samples, and
the same rows get the same samples whichever path runs them. `Rollouter.plan` is what a task
source with its own driver (ms-swift's) takes from the rollouter.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar, runtime_checkable

import torch

from ..chat import ChatFormat, Tokenizer
from ..engines.base import Engine, SamplingParams
from ..engines.sampler import mix_seed
from ..grpo.batch import Layout, TrainingBatch, build_batch
from ..grpo.estimators import (
    AGGREGATIONS,
    SCALES,
    AdvantageInputs,
    BatchStep,
    Estimate,
    EstimatorSettings,
    Scale,
    batch_advantages,
    estimator,
)
from ..types import ChatMessage, Message, Status, Trajectory
from .conversation import Conversation, Environment, Participant, Policy
from .costep import co_step
from .limits import check_time_limit
from .multiturn import EngineRollout, MultiTurnRequest, MultiTurnScheduler, prepare_requests, run_multi_turn
from .outcome import OnSampleError, check_on_sample_error
from .stop import MaxTurns
from .vote import GatherFn

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)  # a sample of a dict row is a sample of an object

_EVAL_SALT = 0x6576616C  # folded into evaluation seeds, so they never repeat a training step's
_EXTRA_SALT = 0x78747261  # folded with a dynamic-sampling round's number into its seeds


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
    advantage_estimator: str = field(
        default="grpo",
        metadata={
            "help": "grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline or a registered name "
            "(grpo/estimators.py)"
        },
    )
    scale_rewards: Literal["group", "batch", "none"] | None = field(
        default=None,
        metadata={
            "help": "divide advantages by the group's reward std, the whole batch's (all ranks), or "
            "nothing (default: the estimator's own; for grpo --scale-by-std decides)"
        },
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = field(
        default="sum_then_normalize",
        metadata={
            "help": "several reward functions: advantages of their weighted sum, or each normalised in "
            "its group, then summed and normalised over the batch (TRL's names; grpo only)"
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "leave out of the loss every sample whose last reply hit --max-new-tokens or whose "
            "conversation outgrew the context (they still count in their group's baseline)"
        },
    )
    overlap: int = field(
        default=1,
        metadata={
            "help": "slices of a rank's conversations taking rounds in turn: while the engine generates "
            "one slice's replies, the others' environment and tool turns run (1: off; 2 pays off when "
            "environments or tools take about as long as a round's generation: benchmarks/bench_overlap.py)"
        },
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
    on_sample_error: Literal["skip", "raise"] = field(
        default="skip",
        metadata={
            "help": "an exception in one sample's scheduler, environment or tool: the sample ends FAILED "
            "and leaves the loss, the others carry on (skip), or the run fails with its traceback (raise)"
        },
    )

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError(f"RolloutConfig.num_generations must be >= 1, got {self.num_generations}")
        if self.overlap < 1:
            raise ValueError(f"RolloutConfig.overlap must be >= 1 (1: off), got {self.overlap}")
        if self.micro_batch_size < 0:
            raise ValueError(f"RolloutConfig.micro_batch_size must be >= 0, got {self.micro_batch_size}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"RolloutConfig.max_batch_size must be >= 1, got {self.max_batch_size}")
        check_time_limit(self.step_timeout_s, "RolloutConfig.step_timeout_s")
        if self.on_timeout not in ("zero", "drop"):
            raise ValueError(
                f"RolloutConfig.on_timeout must be one of ('zero', 'drop'), got {self.on_timeout!r}"
            )
        check_on_sample_error(self.on_sample_error, "RolloutConfig.on_sample_error")
        self.check_advantages()
        _ = self.sampling  # SamplingParams validates temperature and max_new_tokens

    def check_advantages(self) -> None:
        name = self.advantage_estimator
        spec = estimator(name, "RolloutConfig.advantage_estimator")  # names the registered ones
        if self.scale_rewards is not None and self.scale_rewards not in SCALES:
            raise ValueError(
                f"RolloutConfig.scale_rewards must be one of {SCALES} or None, got {self.scale_rewards!r}"
            )
        if self.multi_objective_aggregation not in AGGREGATIONS:
            raise ValueError(
                f"RolloutConfig.multi_objective_aggregation must be one of {AGGREGATIONS}, "
                f"got {self.multi_objective_aggregation!r}"
            )
        if self.scale_rewards is not None and self.scale_rewards not in spec.scales:
            raise ValueError(
                f"RolloutConfig.scale_rewards {self.scale_rewards!r} does not fit advantage_estimator "
                f"{name!r}, which takes {spec.scales}"
            )
        if not self.scale_by_std and (name != "grpo" or self.scale_rewards not in (None, "none")):
            raise ValueError(
                f"RolloutConfig.scale_by_std=False is grpo's switch (with scale_rewards unset); with "
                f"advantage_estimator {name!r} and scale_rewards {self.scale_rewards!r} set "
                "scale_rewards instead"
            )
        if self.leave_one_out and name not in ("grpo", "rloo"):
            raise ValueError(
                "RolloutConfig.leave_one_out is a baseline of grpo / rloo, not of advantage_estimator "
                f"{name!r}"
            )
        if self.multi_objective_aggregation == "normalize_then_sum" and (
            name != "grpo" or self.scale_rewards is not None or self.leave_one_out or not self.scale_by_std
        ):
            raise ValueError(
                "RolloutConfig.multi_objective_aggregation 'normalize_then_sum' normalises each reward in "
                "its group and the sum over the batch by itself: it takes advantage_estimator 'grpo' with "
                "scale_rewards, leave_one_out and scale_by_std left at their defaults"
            )

    @property
    def advantage_settings(self) -> EstimatorSettings:
        """The estimator's settings, `scale_rewards` resolved (unset: the estimator's default)."""
        spec = estimator(self.advantage_estimator)
        scale: Scale = spec.default_scale
        if self.scale_rewards is not None:
            scale = self.scale_rewards
        elif self.advantage_estimator == "grpo" and not self.scale_by_std:
            scale = "none"
        return EstimatorSettings(
            scale=scale,
            leave_one_out=self.leave_one_out or spec.leave_one_out,
            drop_zero_variance=self.drop_zero_variance,
            aggregation=self.multi_objective_aggregation,
        )

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


class Seats:
    """Who plays the policy seats of a lineup: `seats(name)` is the trainer's choice for the seat
    (trained, or frozen when the task source says so); `seats.frozen(name)` asks for the frozen
    copy of the initial weights, for a seat in the phase's frozen seats (`allowed`)."""

    def __init__(
        self, pick: Callable[[str], Policy], frozen: Callable[[str], Policy], allowed: Sequence[str]
    ):
        self._pick, self._frozen, self.allowed = pick, frozen, tuple(allowed)

    def __call__(self, name: str) -> Policy:
        return self._pick(name)

    def frozen(self, name: str) -> Policy:
        if name not in self.allowed:
            raise ValueError(
                f"seat {name!r} asks for the frozen initial weights, but the task source names "
                f"{list(self.allowed) or 'no seat'} for them in this phase: declare it in the source's "
                "frozen_seats (training) or eval_frozen_seats (evaluation), so every rank builds that engine"
            )
        return self._frozen(name)


@runtime_checkable
class Task(Protocol):
    """One row of a step: an opening transcript, a lineup, and a turn cap.

    `lineup(seat)` returns the participants in speaking order; `seat(name)` is the trainer's
    policy for a seat (trained, or frozen when the task source says so), so the task decides
    which seats a policy plays and which an environment or fixed opponent takes; `seat` is a
    `Seats`, whose `seat.frozen(name)` gives a seat to the frozen initial weights.
    """

    max_turns: int

    def prompt(self) -> list[Message]: ...

    def lineup(self, seat: Callable[[str], Policy]) -> list[Participant]: ...


class RolloutGroup(Protocol):
    """The rollout group as the rollouter sees it (`distributed.ParallelGroups`)."""

    @property
    def rank(self) -> int: ...  # the global rank: what a failure's message names

    def gather_fn(self) -> GatherFn: ...


@dataclass(frozen=True, kw_only=True)
class Sample(Generic[R_co]):
    """One sample of a row: what every rollout path runs it under (see `expand_rows`)."""

    row: R_co
    group: int  # the row's place on this rank: the sample's advantage group
    generation: int  # which of the row's samples
    index: int  # unique across ranks: names the sample in errors, orders it
    id: str  # the conversation's id (an ms-swift request's uuid)
    seed: int  # the sample's random stream


@dataclass(frozen=True, kw_only=True)
class RolloutPlan(Generic[R_co]):
    """One step's samples on this rank and what a driver runs them with (`Rollouter.plan`)."""

    samples: Sequence[Sample[R_co]]
    group_seed: int  # folded into every turn's seed, with the sample's own and the turn
    engine: Engine
    tokenizer: Tokenizer
    sampling: SamplingParams
    gather_fn: GatherFn  # the rollout group's vote
    rank: int
    step_timeout_s: float | None
    on_sample_error: OnSampleError = "raise"  # one sample's failure: kept on it (skip) or raised


@dataclass
class Rollout:
    """One step's rollouts on this rank (after scoring: rewards, advantages, keep)."""

    trajectories: list[Trajectory]  # [N] in (row, generation, seat) order
    rows: list[object]  # [N] the row each trajectory came from
    advantages: torch.Tensor | None = None  # [N] float32
    keep: torch.Tensor | None = None  # [N] bool: False for dropped groups and dropped timeouts
    batch_step: BatchStep | None = None  # the estimator's step still to run over the world's batch
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
    a frozen copy of the initial weights that plays but never trains. With `eval_frozen_seats`
    evaluation rows may give those seats to the same copy (`Seats.frozen`): a win rate against
    the initial weights.
    """

    def __init__(
        self,
        *,
        engine: Engine,
        tokenizer: Tokenizer,
        groups: RolloutGroup,
        config: RolloutConfig,
        frozen_seats: Sequence[str] = (),
        eval_frozen_seats: Sequence[str] = (),
        frozen_engine: Callable[[], Engine] | None = None,
        stop: Sequence[str] = (),
    ):
        wanted = [*frozen_seats, *eval_frozen_seats]
        if wanted and frozen_engine is None:
            raise ValueError(
                f"frozen seats {list(dict.fromkeys(wanted))} need a frozen_engine (the backend's)"
            )
        self.engine, self.tokenizer, self.groups, self.config = engine, tokenizer, groups, config
        self.frozen_seats, self._frozen_engine_fn = tuple(frozen_seats), frozen_engine
        self.eval_frozen_seats = tuple(eval_frozen_seats)
        self._policies: dict[tuple[str, bool], Policy] = {}
        # a step's extra round of dynamic sampling (trainers/dynamic.py): 0 for the step's own
        self.extra_round = 0
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

    def _frozen_in(self, evaluation: bool) -> tuple[str, ...]:
        """The seats the frozen copy may play in this phase (known on every rank before it starts)."""
        return self.frozen_seats + (self.eval_frozen_seats if evaluation else ())

    def engines(self, *, evaluation: bool = False) -> list[Engine]:
        """Every engine a lineup may use: a rank holding none of a frozen seat still joins its calls."""
        return [self.engine, self._frozen_engine()] if self._frozen_in(evaluation) else [self.engine]

    def _frozen_engine(self) -> Engine:
        assert self._frozen_engine_fn is not None, "__init__ refuses frozen seats without a frozen_engine"
        return self._frozen_engine_fn()

    # -- the step ---------------------------------------------------------------------------------
    def plan(self, rows: Sequence[R], step: int, *, evaluation: bool = False) -> RolloutPlan[R]:
        """This rank's samples of `rows` and what a driver runs them with (no engine call).

        Training takes `num_generations` samples of every row; evaluation one, under seeds no
        training step uses. Every rollout path (lineups, native and ms-swift schedulers) runs
        the samples of a plan, so a row's samples get the same seeds, indices and ids on each.
        """
        cfg, salt = self.config, (_EVAL_SALT,) if evaluation else ()
        extra = self.extra_round if not evaluation else 0
        stream = (cfg.seed, step, *salt, *((_EXTRA_SALT, extra) if extra else ()))
        return RolloutPlan(
            samples=expand_rows(
                rows,
                num_generations=1 if evaluation else cfg.num_generations,
                rank=self.groups.rank,
                stream=stream,
                tag=f"eval{step}" if evaluation else f"s{step}" + (f"x{extra}" if extra else ""),
            ),
            group_seed=mix_seed(*stream),
            engine=self.engine,
            tokenizer=self.tokenizer,
            sampling=self.sampling,
            gather_fn=self.groups.gather_fn(),
            rank=self.groups.rank,  # the global rank: what a failure's message names
            step_timeout_s=cfg.step_timeout_s,
            on_sample_error=cfg.on_sample_error,
        )

    def run(
        self,
        rows: Sequence[object],
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
        plan = self.plan(rows, step)
        if scheduler is not None:
            return self._scheduled(scheduler, plan, reward_key)
        return self._lineups(plan, Seats(self.seat, self._frozen_policy, self._frozen_in(False)))

    def evaluate(self, rows: Sequence[object], step: int) -> Rollout:
        """Each row played once, the trained policy in every policy seat (collective).

        Also a seat a frozen opponent holds in training: evaluation measures what training
        changes. A row may still give a seat to the frozen initial weights (`Seats.frozen`, one
        of `eval_frozen_seats`): the games against them. Seeds differ from every training step's.
        """
        seats = Seats(self.trained, self._frozen_policy, self._frozen_in(True))
        return self._lineups(self.plan(rows, step, evaluation=True), seats, evaluation=True)

    def _frozen_policy(self, name: str) -> Policy:
        return self._policy(name, frozen=True)

    def _lineups(self, plan: RolloutPlan[object], seats: Seats, *, evaluation: bool = False) -> Rollout:
        convs = [_conversation(s, seats) for s in plan.samples]
        co_step(
            convs,
            turns=None,
            max_batch_size=self.config.max_batch_size,
            group_seed=plan.group_seed,
            gather_fn=plan.gather_fn,
            rank=plan.rank,
            engines=self.engines(evaluation=evaluation),
            step_timeout_s=plan.step_timeout_s,
            on_sample_error=plan.on_sample_error,
            overlap=self.config.overlap,
        )
        trajectories, rows = [], []
        for conv, sample in zip(convs, plan.samples, strict=True):
            for t in conv.trajectories():
                describe(t, conv, sample)
                trajectories.append(t)
                rows.append(sample.row)
        return Rollout(trajectories=trajectories, rows=rows, conversations=convs)

    def _scheduled(
        self, scheduler: MultiTurnScheduler, plan: RolloutPlan[object], reward_key: str
    ) -> Rollout:
        chat = self.trained("policy").chat
        requests = [_request(chat, s) for s in plan.samples]
        rollout_fn = EngineRollout(plan.engine, chat, seed=plan.group_seed)
        requests = prepare_requests(scheduler, requests)  # the scheduler's before_first_turn
        first = rollout_fn(requests, plan.sampling)  # collective: every rank has rows every step
        outputs = run_multi_turn(
            requests,
            first,
            scheduler,
            rollout_fn,
            plan.sampling,
            gather_fn=plan.gather_fn,
            rank=plan.rank,
            step_timeout_s=plan.step_timeout_s,
            on_sample_error=plan.on_sample_error,
            overlap=self.config.overlap,
        )
        trajectories = []
        for o, sample in zip(outputs, plan.samples, strict=True):
            t = o.to_trajectory(group=sample.group)
            describe_request(t, sample.id, o.request.messages, reward_key)
            trajectories.append(t)
        return Rollout(trajectories=trajectories, rows=[s.row for s in plan.samples])


def expand_rows(
    rows: Sequence[R], *, num_generations: int, rank: int, stream: Sequence[int], tag: str
) -> list[Sample[R]]:
    """`num_generations` samples of each row, in (row, generation) order: the one expansion of
    every rollout path.

    A sample's group is its row's place on this rank (its samples share an advantage baseline);
    its index, `(rank * len(rows) + row) * num_generations + generation`, is unique across ranks
    that hold as many rows; its id is `<tag>-r<rank>-p<row>-g<generation>`; its seed folds
    `stream`, the rank, the row and the generation, so it depends on nothing else (a resumed run
    replays it).
    """
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    out = []
    for i, row in enumerate(rows):
        for k in range(num_generations):
            index = (rank * len(rows) + i) * num_generations + k
            seed = mix_seed(*stream, rank, i, k)
            cid = f"{tag}-r{rank}-p{i}-g{k}"
            out.append(Sample(row=row, group=i, generation=k, index=index, id=cid, seed=seed))
    return out


def _conversation(sample: Sample[object], seat: Seats) -> Conversation:
    """One sample of a lineup row: its seats filled by `seat`, its turn cap, its own seed."""
    row = sample.row
    if not isinstance(row, Task):  # a dataset row (messages) given to the lineup path
        raise ValueError(
            f"row {sample.group}: expected a Task (prompt(), lineup(seat), max_turns), got {row!r}; "
            "rows of a message dataset need the task source's scheduler"
        )
    return Conversation(
        row.lineup(seat),
        prompt=row.prompt(),
        run_until=MaxTurns(row.max_turns),
        id=sample.id,
        seed=sample.seed,
        group=sample.group,
    )


def _request(chat: ChatFormat, sample: Sample[object]) -> MultiTurnRequest:
    """One sample of a scheduler row: a message list, or a dict whose other fields are its data."""
    row = sample.row
    messages, data = (row.get("messages"), row) if isinstance(row, dict) else (row, {})
    if not isinstance(messages, list):
        raise ValueError(
            f"row {sample.group}: expected a message list or a dict with a 'messages' list, got {row!r}"
        )
    extra = {k: v for k, v in data.items() if k != "messages"}
    return MultiTurnRequest.from_messages(
        chat, messages, index=sample.index, seed=sample.seed, data={**extra, "group": sample.group}
    )


def describe_request(
    t: Trajectory, conversation: str, messages: Sequence[Mapping[str, object]], reward_key: str | None
) -> None:
    """Fill a scheduler sample's `t.infos` with what reward functions and records read: its id,
    transcript, last reply, and as its `env_reward` the scheduler's `rollout_infos[reward_key]`
    (None where the scheduler set none)."""
    info = t.infos
    info.conversation = conversation
    reward = None if reward_key is None else info.extra.get(reward_key)
    info.env_reward = None if reward is None else _number(reward, reward_key, conversation)
    replies = [m.get("content") for m in messages if m.get("role") == "assistant"]
    info.completion = str(replies[-1] or "") if replies else ""
    info.messages = [dict(m) for m in messages]


def _number(value: object, key: str | None, conversation: str) -> float:
    try:
        return float(value)  # type: ignore[arg-type]  # whatever float() takes: numpy, tensors
    except (TypeError, ValueError):
        raise ValueError(
            f"request {conversation}: rollout_infos[{key!r}] is {value!r}; expected a number (the reward)"
        ) from None


def describe(t: Trajectory, conv: Conversation, sample: Sample[object] | None = None) -> None:
    """Fill `t.infos` with what reward functions and records read (see the module docstring)."""
    seat, info = t.participant, t.infos
    if sample is not None:
        info.index = sample.index
    # a failed conversation's environments are not asked: their state is whatever the failure
    # left, and the sample leaves the loss anyway (its environment reward counts as 0)
    failed = conv.status is Status.FAILED
    given = [p.reward_for(conv, seat) for p in conv.lineup if isinstance(p, Environment) and not failed]
    scores = [s for s in given if s is not None]
    info.env_reward = float(sum(scores)) if scores else None
    own = [m.content for m in conv.messages if m.speaker == seat]
    info.completion = own[-1] if own else ""
    # the whole transcript: the row's prompt() (what reward functions see as the prompt), then
    # every committed message under the role the seat's view rendered it with (its own as the
    # assistant's, another seat's as a user's)
    said: list[ChatMessage] = [{"role": m.role, "name": m.speaker, "content": m.content} for m in conv.prompt]
    info.messages = said + [
        {"role": _role_seen(m, seat), "name": m.speaker, "content": m.content} for m in conv.messages
    ]
    # a row that opens with nothing (a game whose environment speaks first) is prompted by what
    # was said before the seat's first message
    first = next((i for i, m in enumerate(conv.messages) if m.speaker == seat), len(conv.messages))
    info.opening = len(conv.prompt) or first
    outcome = conv.infos.get("outcome")
    if isinstance(outcome, dict):
        info.outcome = {str(k): float(v) for k, v in outcome.items()}
    if isinstance(outcome, dict) and seat in outcome:
        info.success = float(outcome[seat])
    elif conv.infos.get("success") is not None:
        info.success = float(conv.infos["success"])


def _role_seen(m: Message, seat: str) -> str:
    """The role `seat`'s view renders `m` with (`Conversation._append_to_view`)."""
    return "assistant" if m.speaker == seat else "user" if m.role == "assistant" else m.role


def rollout_advantages(
    trajectories: Sequence[Trajectory], config: RolloutConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rollout_estimate`'s advantages [N] and keep [N], for an estimator with no batch step."""
    out = rollout_estimate(trajectories, config)
    if out.batch is not None:
        raise ValueError(
            f"advantage_estimator {config.advantage_estimator!r} with scale_rewards "
            f"{config.advantage_settings.scale!r} needs the whole batch's statistics: use rollout_estimate "
            "and then whole_batch_advantages"
        )
    return out.advantages, out.keep


def rollout_estimate(
    trajectories: Sequence[Trajectory],
    config: RolloutConfig,
    components: Mapping[str, Sequence[float | None]] | None = None,
    weights: Sequence[float] | None = None,
) -> Estimate:
    """The estimator's advantages [N], keep [N] and batch step per (prompt, seat) group; timed-out
    samples scored 0 or left out, failed ones (status FAILED, whatever marked them: the rollout or a
    reward) and unscored ones (every reward function returned None) always left out.

    Rewards must be set. A dropped sample must not move its group's baseline, so advantages are
    computed over the others only. `components` (each reward function's values, None where it gave
    none) and their `weights` are what `multi_objective_aggregation="normalize_then_sum"` reads;
    without them the total is the one component.
    """
    timed_out = [t.status is Status.TIMEOUT for t in trajectories]
    if config.on_timeout == "zero":
        for t, late in zip(trajectories, timed_out, strict=True):
            t.reward = 0.0 if late else t.reward
    dropped = [
        t.status is Status.FAILED or (late and config.on_timeout == "drop")
        for t, late in zip(trajectories, timed_out, strict=True)
    ]
    seats = sorted({t.participant for t in trajectories})
    key = [t.group * len(seats) + seats.index(t.participant) for t in trajectories]  # (prompt, seat)
    used = [i for i, out in enumerate(dropped) if not out]
    used = [i for i in used if not trajectories[i].infos.unscored]  # every reward said None (TRL)
    settings = config.advantage_settings
    if settings.leave_one_out:  # a sample its group's drops left alone has no baseline: it leaves too
        full = {k: key.count(k) for k in set(key)}
        left = {k: sum(key[i] == k for i in used) for k in set(key)}
        used = [i for i in used if left[key[i]] > 1 or full[key[i]] == 1]
    adv = torch.zeros(len(trajectories))
    keep = torch.zeros(len(trajectories), dtype=torch.bool)
    batch: BatchStep | None = None
    if used:
        zeroed = timed_out if config.on_timeout == "zero" else None
        table = _components(trajectories, components, weights, zeroed)
        _, dense = torch.unique(torch.tensor([key[i] for i in used]), return_inverse=True)
        inputs = AdvantageInputs(
            rewards=torch.tensor([_reward(trajectories[i]) for i in used], dtype=torch.float64),
            groups=dense,
            components=table[0][used],
            weights=table[1],
        )
        out = estimator(config.advantage_estimator).fn(inputs, settings)
        adv[used], keep[used], batch = out.advantages, out.keep, out.batch
    else:  # no sample in a baseline here: the batch step's all-reduces still need this rank, so
        # the estimator is asked for it on a placeholder sample
        batch = estimator(config.advantage_estimator).fn(_NO_INPUTS, settings).batch
    if config.mask_truncated_completions:  # TRL's mask_truncated_completions, ms-swift's overlong_filter
        keep &= torch.tensor([not cut_short(t) for t in trajectories], dtype=torch.bool)
    return Estimate(advantages=adv, keep=keep, batch=batch)


_NO_INPUTS = AdvantageInputs(  # two samples of one group: a leave-one-out baseline exists
    rewards=torch.zeros(2, dtype=torch.float64),
    groups=torch.zeros(2, dtype=torch.int64),
    components=torch.zeros(2, 1, dtype=torch.float64),
    weights=torch.ones(1, dtype=torch.float64),
)


def _components(
    trajectories: Sequence[Trajectory],
    components: Mapping[str, Sequence[float | None]] | None,
    weights: Sequence[float] | None,
    zeroed: Sequence[bool] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, F] each function's values (NaN: none given; 0 for a sample `zeroed` marks) and [F] weights."""
    n = len(trajectories)
    if components is None:
        totals = torch.tensor([[_reward(t)] for t in trajectories], dtype=torch.float64)  # [N, 1]
        return totals, torch.ones(1, dtype=torch.float64)
    names = list(components)
    w = [1.0] * len(names) if weights is None else [float(x) for x in weights]
    if len(w) != len(names) or any(len(components[k]) != n for k in names):
        raise ValueError(
            f"rollout_estimate: components must give {n} values for each of {len(w)} weights, got "
            f"{ {k: len(v) for k, v in components.items()} }"
        )
    rows = [[components[k][i] for k in names] for i in range(n)]
    table = torch.tensor(
        [[math.nan if v is None else float(v) for v in row] for row in rows], dtype=torch.float64
    ).reshape(n, len(names))
    if zeroed is not None:
        table[torch.tensor(list(zeroed), dtype=torch.bool)] = 0.0
    return table, torch.tensor(w, dtype=torch.float64)


def whole_batch_advantages(rollout: Rollout, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """The rollout's batch step (if any) on its advantages, in place, with statistics over the samples
    in the loss of every rank `reduce_sum` spans (collective: call it on every rank, after the
    step's local phases; `reduce_sum` sums a float64 tensor over the world)."""
    step = rollout.batch_step
    if step is None:
        return
    assert rollout.advantages is not None and rollout.keep is not None, "score the rollout first"
    tokens = torch.tensor([float(t.num_trained_tokens) for t in rollout.trajectories], dtype=torch.float64)
    each = tokens if step.by_tokens else torch.ones_like(tokens)
    weights = torch.where(rollout.keep & (tokens > 0), each, 0.0)  # [N]: the samples in the loss
    rewards = torch.tensor([_reward(t) for t in rollout.trajectories], dtype=torch.float64)
    adv = batch_advantages(rollout.advantages, rewards, weights, step, reduce_sum)
    rollout.advantages = torch.where(rollout.keep, adv, torch.zeros_like(adv))
    rollout.batch_step = None  # done: a second call must not scale twice


def cut_short(t: Trajectory) -> bool:
    """Whether the sample ended cut off: its last trained reply at the token cap, or its
    conversation past the context."""
    trained = [span for span in t.turns if span.trained]
    return t.status is Status.TRUNCATED or bool(trained and trained[-1].finish_reason == "length")


def _reward(t: Trajectory) -> float:
    if t.reward is None:
        raise ValueError(
            f"a trajectory of group {t.group} (seat {t.participant!r}) has no reward; score every one first"
        )
    return float(t.reward)


def micro_batches(
    rollout: Rollout, *, micro_batch_size: int, layout: Layout, pad_to_multiple: int, pad_id: int
) -> list[TrainingBatch | None]:
    """Micro-batches of the kept trajectories; trajectories with no trained token are skipped,
    and each ends at its last trained token (`trained_prefix`).

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
    pairs = [(trained_prefix(t), a) for t, a in pairs]
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


def trained_prefix(t: Trajectory) -> Trajectory:
    """`t` up to and including its last trained token.

    What follows it (an environment's answer to the last reply, a closing message) is read by
    no trained position under causal attention: it changes no logprob of the loss and would only
    cost the forward and backward. The same object when nothing follows; a copy otherwise, with
    the turn spans cut at the new end.
    """
    end = max((i for i, m in enumerate(t.loss_mask) if m), default=-1) + 1
    if end in (0, len(t.token_ids)):
        return t
    turns = [dataclasses.replace(s, end=min(s.end, end)) for s in t.turns if s.start < end]
    return dataclasses.replace(t, token_ids=t.token_ids[:end], loss_mask=t.loss_mask[:end], turns=turns)
