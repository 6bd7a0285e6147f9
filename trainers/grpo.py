"""`GRPOTrainer`: the GRPO loop, composed of a backend, a task source and reward functions.

One step, on every rank::

    rows     = tasks.rows(prompts_per_rank, seed)        # a pure function of (seed, step, rank)
    rollout  = rollouter.run(rows, step)                 # collective multi-turn rollout
    rewards  = reward_fns(trajectories, rows)            # weighted, each logged apart
    adv      = rollout_estimate(trajectories)            # per (prompt, seat) group
    kl       = --kl-in-reward: rewards - beta * KL, adv again # collective forwards (kl_reward.py)
    adv      = whole_batch_advantages(rollout)           # batch statistics over the world, if any
    batches  = micro_batches(rollout)                    # packed THD or padded
    for each update: logprobs -> loss -> backward; backend.optimizer_step()
    backend.sync_engine_weights()                        # a colocated vLLM gets the new weights
    log; checkpoint every save_every steps

Extension points (none of them a subclass of this class): the `Backend` (trainers.backends), the
`TaskSource` (interlens_mcore.tasks), the reward functions (interlens_mcore.grpo.rewards) and
`loss_fn` (same signature as `interlens_mcore.grpo.loss.objective.batch_loss`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from interlens_mcore import distributed
from interlens_mcore.engines.sampler import mix_seed
from interlens_mcore.grpo.batch import pad_id
from interlens_mcore.grpo.loss.config import LossConfig
from interlens_mcore.grpo.loss.objective import batch_loss
from interlens_mcore.grpo.rewards import WeightedRewards, environment_reward
from interlens_mcore.rollout.rollouter import (
    Rollout,
    RolloutConfig,
    Rollouter,
    micro_batches,
    rollout_estimate,
    whole_batch_advantages,
)
from interlens_mcore.tasks import TaskSource

from . import dynamic, kl_reward, preemption, rundir, state
from .backends.base import Backend
from .config import TrainerConfig
from .report import record
from .report.failures import step_failures
from .report.first_errors import FirstErrors
from .report.health import HealthCheck
from .report.reporter import Reporter
from .schedule import lr_at
from .update import update

_EVAL_SEED = 0x65
_EXTRA_ROWS = 0x78  # folded with a dynamic-sampling round's number into its rows' seed


T = TypeVar("T")


def describe_run(
    config: TrainerConfig,
    rollout_config: RolloutConfig,
    loss_config: LossConfig,
    tasks: TaskSource,
    rewards: WeightedRewards,
    world_size: int,
) -> dict[str, object]:
    """The effective configuration: what run.json records and a resumption must match."""
    return {
        **dataclasses.asdict(config),
        **dataclasses.asdict(rollout_config),
        **dataclasses.asdict(loss_config),
        "task_source": tasks.describe(),
        "rewards": rewards.names,
        "reward_weights": rewards.weights,
        "world_size": world_size,
    }


def supervised_steps_left(cfg: TrainerConfig, *, step: int, sft_step: int) -> int:
    """--sft-data: the supervised steps still to run. A run cut during the phase continues it; one
    cut after it (a GRPO step done, or the phase's last step saved) does not redo it."""
    return max(cfg.sft_steps - sft_step, 0) if cfg.sft_data and step == 0 else 0


class GRPOTrainer:
    """GRPO on multi-turn rollouts; see the module docstring for one step."""

    def __init__(
        self,
        *,
        backend: Backend,
        tasks: TaskSource,
        groups: distributed.ParallelGroups,
        tokenizer: PreTrainedTokenizerBase,
        config: TrainerConfig | None = None,
        rollout_config: RolloutConfig | None = None,
        loss_config: LossConfig | None = None,
        rewards: Sequence[Callable] | None = None,
        reward_weights: Sequence[float] | None = None,
        loss_fn: Callable = batch_loss,
        run_info: dict | None = None,
        world_check_timeout_s: float | None = None,
    ):
        self.config = config = config or TrainerConfig()
        self.rollout_config = rollout_config or RolloutConfig()
        # --gradient-accumulation-steps N: a rank's trajectories of a step in N equal micro-batches
        per_rank = config.batch_size * len(tasks.trained_seats)
        micro = config.micro_batch_size(per_rank, self.rollout_config.micro_batch_size)
        self.rollout_config = dataclasses.replace(self.rollout_config, micro_batch_size=micro)
        self.loss_config = loss_config or LossConfig()
        self.backend, self.tasks, self.groups, self.tokenizer = backend, tasks, groups, tokenizer
        self.loss_fn = loss_fn
        n = self.rollout_config.num_generations
        if config.batch_size % n:
            raise ValueError(
                f"RolloutConfig.num_generations {n} does not fit "
                f"TrainerConfig.batch_size {config.batch_size}: "
                "the batch must hold whole groups (a positive multiple of num_generations)"
            )
        self.check_micro_batches()
        if self.loss_config.beta > 0 and not backend.has_reference:
            raise ValueError(
                f"LossConfig.beta {self.loss_config.beta} > 0 needs a backend built with reference=True"
            )
        if config.sync_ref_model:
            if not self.loss_config.beta > 0:
                raise ValueError("TrainerConfig.sync_ref_model moves the KL reference: it needs --beta > 0")
            frozen = tuple(dict.fromkeys([*tasks.frozen_seats, *tasks.eval_frozen_seats]))
            if frozen:
                raise ValueError(
                    "TrainerConfig.sync_ref_model would move the frozen seats' weights too "
                    f"({', '.join(frozen)} play the reference model): drop one"
                )
            if not callable(getattr(backend, "mix_reference", None)):
                raise ValueError(
                    f"TrainerConfig.sync_ref_model: the backend {type(backend).__name__} has no mix_reference"
                )
        self.kl_control = self.reward_kl_controller()
        # with --kl-in-reward the KL lowers the rewards and the loss has no KL term
        self.update_loss_config = (
            dataclasses.replace(self.loss_config, beta=0.0) if config.kl_in_reward else self.loss_config
        )
        self.rollouter = Rollouter(
            engine=backend.engine,
            tokenizer=tokenizer,
            groups=groups,
            config=self.rollout_config,
            frozen_seats=tasks.frozen_seats,
            eval_frozen_seats=tasks.eval_frozen_seats,
            # a frozen opponent keeps the backend's own engine over the initial weights, with
            # --engine vllm too: its weights never change, so nothing is synced into it
            frozen_engine=backend.frozen_engine,
            stop=tasks.stop,
        )
        self.rewards = WeightedRewards(
            list(rewards or [environment_reward]),
            reward_weights,
            raise_errors=self.rollout_config.on_sample_error == "raise",  # a raising reward: one sample
        )
        self.rewards.state.max_steps = config.steps
        # every rank writes into the folder rank 0 names (a fresh one when none is given)
        chosen = config.output_dir or str(rundir.fresh_name(tasks.name))
        self.output_dir = Path(distributed.all_gather_object(chosen)[0])
        described = describe_run(
            config, self.rollout_config, self.loss_config, tasks, self.rewards, distributed.world_size()
        )
        self.run_info = {**described, **(run_info or {}), "output_dir": str(self.output_dir)}
        self.step, self.skipped_steps, self.resumed = 0, 0, False
        self.sft_step = 0  # --sft-data: supervised steps done (checkpointed)
        self.claim: state.FolderClaim | None = None  # the output folder, once taken
        self.stop = preemption.StopRequest(config.save_on_signal)  # SIGTERM / SIGINT: save and stop
        self.health = HealthCheck(max_new_tokens=self.rollout_config.max_new_tokens)
        # what the progress bar says the step is doing (the Reporter's note while `train` runs)
        self.say: Callable[[str], None] = lambda text: None
        self.warn: Callable[[str], None] = lambda text: None  # a health warning (rank 0's report)
        self.first_errors = FirstErrors()  # each cause of failed samples said once, counted after
        # a failure on any rank reaches every rank of the world as its named cause, at once; the
        # check waits as long as any collective may (a rank that failed early waits there)
        timeout = world_check_timeout_s if world_check_timeout_s is not None else config.collective_timeout_s
        self.world_check = distributed.world_check_group(timeout_s=timeout)

    def reward_kl_controller(self) -> kl_reward.KLController | None:
        cfg, beta = self.config, self.loss_config.beta
        if not cfg.kl_in_reward:
            return None
        if not beta > 0:
            raise ValueError(
                "TrainerConfig.kl_in_reward: --beta is the KL's coefficient in the reward: give --beta > 0"
            )
        aggregation = self.rollout_config.multi_objective_aggregation
        if aggregation != "sum_then_normalize":
            raise ValueError(
                f"TrainerConfig.kl_in_reward with multi_objective_aggregation {aggregation!r}: the KL "
                "lowers the total reward, which that aggregation does not read (use sum_then_normalize)"
            )
        return kl_reward.KLController(beta, cfg.kl_ctrl, cfg.kl_target, cfg.kl_horizon)

    def check_micro_batches(self) -> None:
        expected = self.backend.micro_batches
        if expected is None:
            return
        per_rank = self.config.batch_size * len(self.tasks.trained_seats)
        size = self.rollout_config.micro_batch_size or per_rank
        if math.ceil(per_rank / size) != expected:
            raise ValueError(
                f"{math.ceil(per_rank / size)} micro-batches per step ({per_rank} trajectories, "
                f"micro_batch_size {size}) but the backend steps after {expected}: "
                "build it for this micro-batch count"
            )

    # -- the loop ----------------------------------------------------------------------------
    def train(self) -> list[dict]:
        """Run (or continue) to `config.steps`; returns the records of the steps run here."""
        cfg = self.config
        state.claim_output_dir(self)
        start = self.step
        report = Reporter(
            self.output_dir,
            reporters=cfg.reporters,
            total=cfg.steps,
            start=self.step,
            enabled=self.groups.rank == 0,
            run_info=self.run_info,
        )
        records = []
        self.say, self.warn = report.note, report.warn
        self.stop.start()
        try:
            if supervised_steps_left(cfg, step=self.step, sft_step=self.sft_step):
                with distributed.stage(f"supervised step {self.sft_step}"):
                    self.supervised_phase(report)
            while self.step < cfg.steps and not self.stop.agreed(self.world_check):
                with distributed.stage(f"step {self.step}"):
                    records.append(self.step_and_log(report))
            if self.stop.stopped:  # every rank agreed after the same step: save it, end here
                with distributed.stage(f"step {self.step} / checkpoint"):
                    state.save_on_stop(self, start)
            elif cfg.eval_every:  # the weights the run ends with
                with distributed.stage(f"step {self.step}"):
                    report.note(self.evaluating())
                    report.log({"step": self.step, **self.evaluation()})
        except BaseException:
            report.close(steps=self.step, failed=True)  # quickly: the caller names the cause
            raise
        else:
            for line in self.first_errors.repeats():
                report.warn(line)
            report.close(steps=self.step)
        finally:
            self.stop.finish()
            state.release_output_dir(self)
        return records

    def supervised_phase(self, report: Reporter) -> None:
        """--sft-data: the rest of the supervised warm-up, then the KL reference set to its weights
        (unless --ref-from base, or LoRA, whose reference is the base model with adapters off)."""
        from interlens_mcore.chat import ChatFormat

        from .sft import SupervisedPhase, demonstration_trajectories, read_demonstrations

        cfg = self.config
        assert cfg.sft_data is not None
        phase = SupervisedPhase(
            trajectories=demonstration_trajectories(
                ChatFormat(self.tokenizer), read_demonstrations(cfg.sft_data)
            ),
            steps=cfg.sft_steps,
            batch_size=cfg.sft_batch_size,
            lr=cfg.sft_lr,
        )

        def save(done: int) -> None:
            self.sft_step = done
            if done == cfg.sft_steps:  # the warmed-up policy becomes the reference before it is saved
                self.reference_from_policy()
            with distributed.stage("checkpoint"):
                state.save_checkpoint(self)

        self.say(f"supervised warm-up: {len(phase.trajectories)} demonstrations")
        phase.run(
            self.backend,
            self.groups,
            start=self.sft_step,
            pad_id=pad_id(self.tokenizer),
            log=report.log_sft,
            save=save,
            save_every=cfg.save_every,
        )
        self.backend.sync_engine_weights()

    def reference_from_policy(self) -> None:
        mix = getattr(self.backend, "mix_reference", None)
        if self.config.ref_from != "policy" or not self.backend.has_reference or mix is None:
            return
        if getattr(self.backend, "_adapters_off_reference", False):
            return  # LoRA: the reference is the base model itself
        mix(1.0)

    def step_and_log(self, report: Reporter) -> dict:
        """One step of the loop: evaluation when due, the step, its record, a checkpoint when due."""
        cfg = self.config
        evaluated = {}
        if cfg.eval_every and self.step % cfg.eval_every == 0:
            report.note(self.evaluating())  # the held-out rows may take longer than a step
            evaluated = self.evaluation()
        rec, rollout = self.train_step()
        rec = record.json_ready({**rec, **evaluated})
        health, warnings = self.health.check(rec)
        rec.update(health)
        report.log(rec)
        for line in warnings:
            report.warn(line)
        if cfg.log_completions_every and self.step % cfg.log_completions_every == 0:
            report.completions(self.step, self.together("completions", self.completions, rollout))
        self.step += 1
        if self.step % cfg.save_every == 0 or self.step == cfg.steps:
            with distributed.stage("checkpoint"):
                state.save_checkpoint(self)
            report.plot()
        return rec

    def train_step(self) -> tuple[dict, Rollout]:
        """One rollout and its `updates_per_rollout` optimizer steps; returns (record, rollout)."""
        t0 = time.perf_counter()
        self.say(f"step {self.step}: rollout")
        rollout, components = self.together("rollout", self.scored_rollout, self.step)
        refilled: dict[str, float] = {}
        if self.config.dynamic_sampling:
            rollout, components, refilled = self.refilled(rollout, components)
        with distributed.stage("failed samples"):
            failures = step_failures(rollout.trajectories, self.step)
        for line in self.first_errors.new(failures):  # a cause met for the first time, said now
            self.warn(line)
        # before the update: a step whose samples mostly failed trains nothing (every rank raises)
        failures.check(self.config.max_failed_fraction)
        with distributed.stage("advantages"):  # an estimator's batch step: over the world's samples
            penalty = self.advantages(rollout)
        with distributed.stage("rollout figures"):
            figures = self.rollout_record(rollout, components, t0)
        # a warning the rollout alone makes due is said now: on a slow task the update may take
        # longer than the rollout
        for line in self.health.early({"step": self.step, **figures, **failures.figures()}):
            self.warn(line)
        with distributed.stage("update"):
            rec = self.update_and_record(rollout, figures)
        return {**rec, **failures.figures(), **refilled, **penalty}, rollout

    def rollout_record(self, rollout: Rollout, components: dict[str, list[float | None]], t0: float) -> dict:
        """The step's rollout figures over the world (collective), with `rollout_s` since `t0`."""
        return {
            # over the world, each rank its own samples (before any sharing over TP)
            **record.rollout_figures(
                rollout,
                components,
                None,
                dataset_of=self.tasks.dataset_of,
                logged=self.rewards.take_metrics(),
            ),
            "rollout_s": round(time.perf_counter() - t0, 3),
        }

    def advantages(self, rollout: Rollout) -> dict[str, float]:
        """The estimator's batch step over the world, in place (collective); with --kl-in-reward
        first the rewards lowered by their KL and the advantages estimated again from them
        (trainers/kl_reward.py). Returns the KL figures."""
        reduce_sum = lambda x: distributed.all_reduce(x, "sum")  # noqa: E731
        if self.kl_control is None:
            whole_batch_advantages(rollout, reduce_sum)
            return {}
        kl = self.rollout_kl(rollout)
        coef = self.kl_control.value
        kl_reward.penalized_advantages(rollout, coef * kl.total, self.rollout_config, reduce_sum)
        mine = torch.tensor(kl_reward.mean_token_kl(kl), dtype=torch.float64)
        total, count = distributed.all_reduce(mine, "sum").tolist()
        mean = total / count if count else 0.0
        self.kl_control.update(mean, int(count))
        return {"kl_in_reward/kl": mean, "kl_in_reward/coef": coef}

    def rollout_kl(self, rollout: Rollout) -> kl_reward.SampleKL:
        """This rank's samples' KL to the reference; under TP computed on the TP group's union
        (its ranks forward the same rows) and this rank's part taken."""
        lcfg = self.loss_config
        shared = self.share_over_tp(rollout)
        kl = kl_reward.sample_kl(
            self.backend,
            shared.trajectories,
            micro_batch_size=self.rollout_config.micro_batch_size,
            pad_id=pad_id(self.tokenizer),
            estimator=lcfg.kl_estimator,
            clamp=lcfg.log_ratio_clamp,
            output_clamp=lcfg.kl_clamp,
        )
        mine = len(rollout.trajectories)
        return kl if self.groups.tp_size == 1 else kl_reward.own_part(kl, mine, self.groups.tp)

    def refilled(
        self, rollout: Rollout, components: dict[str, list[float | None]]
    ) -> tuple[Rollout, dict[str, list[float | None]], dict[str, float]]:
        """Extra rounds until every rank has its prompts' worth of informative ones, or the cap
        (trainers/dynamic.py); the rounds' count agreed over the world, after each world check."""
        quota = self.config.batch_size // self.rollout_config.num_generations
        rounds = [(rollout, components)]
        extra = 0
        while True:
            short = dynamic.shortfall([r for r, _ in rounds], quota)
            worst = distributed.all_reduce(torch.tensor([short], dtype=torch.int64), "max")
            if int(worst[0]) == 0 or extra == self.config.max_extra_rounds:
                break
            extra += 1
            self.rollouter.extra_round = extra
            try:
                rounds.append(self.together("rollout", self.scored_rollout, self.step))
            finally:
                self.rollouter.extra_round = 0
        batch, parts, kept = dynamic.refill(rounds, quota)
        kept_all = distributed.all_reduce(torch.tensor([kept], dtype=torch.int64), "sum")
        figures = {"dynamic/extra_rounds": float(extra), "dynamic/kept_groups": float(kept_all[0])}
        return batch, parts, figures

    def update_and_record(self, rollout: Rollout, figures: dict) -> dict:
        """The collective part of a step, after its world check: the update, and the step's record
        from the rollout's `figures` (`rollout_record`) and the update's."""
        rcfg, cfg = self.rollout_config, self.config
        shared = self.share_over_tp(rollout)
        t1 = time.perf_counter()
        lr = lr_at(self.step, self.config)
        self.backend.set_lr(lr)  # the schedule's value for this step's updates (trainers/schedule.py)
        batches = micro_batches(
            shared,
            micro_batch_size=rcfg.micro_batch_size,
            layout=self.backend.layout,
            pad_to_multiple=self.backend.pad_to_multiple,
            pad_id=pad_id(self.tokenizer),
        )
        result = update(
            self.backend,
            batches,
            shared,
            loss_config=self.update_loss_config,
            updates=self.config.updates_per_rollout,
            loss_fn=self.loss_fn,
            dp_group=self.groups.dp,
            progress=lambda done, total: self.say(f"step {self.step}: update, micro-batch {done} of {total}"),
        )
        self.say(f"step {self.step}: figures")
        self.skipped_steps += result.skipped
        metrics = result.metrics
        # once after the rollout's optimizer steps: nothing generates between them. The slowest
        # rank's time is the step's (collective: every rank syncs here)
        if cfg.sync_ref_model and (self.step + 1) % cfg.ref_model_sync_steps == 0:
            self.backend.mix_reference(cfg.ref_model_mixup_alpha)  # type: ignore[attr-defined]
        sync = torch.tensor([self.backend.sync_engine_weights()], dtype=torch.float64)
        sync_s = float(distributed.all_reduce(sync, "max")[0])
        t2 = time.perf_counter()
        return {
            "step": self.step,
            **figures,
            **record.train_figures(metrics, skipped_steps=self.skipped_steps),
            "learning_rate": lr,  # the schedule's rate of this step (TRL's name)
            "train_s": round(t2 - t1, 3),
            "weight_sync_s": round(sync_s, 4),
        }

    def together(self, stage: str, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` as a local phase named `stage`, then the world agrees that no rank failed.

        The rule (distributed/collectives.py, "stages and local phases"): every piece of user code (task
        sources, environments, tools, schedulers, rewards, `success_of`) runs inside a block
        like this one, whose only collectives are the rollout's own (each after the rollout's
        vote); world and DP collectives come after the block's `distributed.check_world`, which
        every rank reaches whatever its code did. A rank whose code raised then never leaves a
        peer waiting in another collective: the check names the failure on every rank.
        """
        error: Exception | None = None
        try:
            with distributed.local_phase(stage, self.groups.rollout_collectives):
                out = fn(*args)
        except Exception as exc:  # reported to every rank, re-raised below as WorldFailure
            error = exc
        distributed.check_world(error, self.world_check)  # raises on every rank if any failed
        assert error is None, "check_world raises when any rank failed"
        return out

    def scored_rollout(self, step: int) -> tuple[Rollout, dict[str, list[float | None]]]:
        """This rank's rollout of `step` with rewards and advantages set, and each reward's values."""
        cfg, rcfg = self.config, self.rollout_config
        extra = self.rollouter.extra_round  # a dynamic-sampling round draws rows of its own
        seed = mix_seed(rcfg.seed, step, self.groups.rank, *((_EXTRA_ROWS, extra) if extra else ()))
        rows = self.tasks.rows(cfg.batch_size // rcfg.num_generations, seed=seed)
        rollout = self.tasks.run(self.rollouter, rows, step)
        totals, components = self.rewards.score(rollout.trajectories, rollout.rows, step=step)
        self.score(rollout.trajectories, totals)
        # local: an estimator's batch-level statistics wait for train_step, after the world check
        est = rollout_estimate(rollout.trajectories, rcfg, components, self.rewards.weights)
        rollout.advantages, rollout.keep, rollout.batch_step = est.advantages, est.keep, est.batch
        return rollout, components

    def score(self, trajectories: list, totals: list[float]) -> None:
        """Set each trajectory's reward, then its success as the task judges it."""
        for t, r in zip(trajectories, totals, strict=True):
            t.reward = r
            success = self.tasks.success_of(t)
            if success is not None:
                t.infos.success = float(success)

    def share_over_tp(self, rollout: Rollout) -> Rollout:
        """Under TP (and PP) every rank of a model-parallel group trains on the same samples: the
        group's union.

        Conversations stay local (they hold engines, which hold process groups), and so do the
        rows (a task may hold an unpicklable environment): rewards are already set.
        """
        pipelined = self.groups.pp is not None and distributed.world_size(self.groups.pp) > 1
        if not pipelined and self.groups.tp_size == 1:
            return rollout
        group = self.groups.rollout if pipelined else self.groups.tp  # megatron's rollout: TP x PP
        mine = (rollout.trajectories, rollout.advantages, rollout.keep)
        parts = distributed.all_gather_object(mine, group=group)
        trajectories = [t for p in parts for t in p[0]]
        return Rollout(
            trajectories=trajectories,
            rows=[None] * len(trajectories),
            advantages=torch.cat([p[1] for p in parts]),
            keep=torch.cat([p[2] for p in parts]),
        )

    def evaluation(self) -> dict[str, float]:
        """The task's held-out rows with the current weights (collective): `eval/...` figures.

        Two local phases (drawing the rows; playing and scoring them), each ended by the world
        check; the gathers that decide and merge come after those checks.
        """
        rows = self.together("evaluation rows", self.eval_rows)
        if not any(distributed.all_gather_object(bool(rows))):
            return {}
        rollout = self.together("evaluation", self.scored_evaluation, rows)
        with distributed.stage("evaluation figures"):
            return record.evaluation_figures(rollout)

    def evaluating(self) -> str:
        """What the progress bar says while the held-out rows are played."""
        return f"evaluating {self.config.eval_size * distributed.world_size()} held-out rows"

    def eval_rows(self) -> list[object]:
        """This rank's held-out rows (local)."""
        # one draw for the whole world, the same every time; rank r plays rows r, r + world, ...
        # so the ranks hold distinct rows (and each its share of every seat's block)
        world = distributed.world_size()
        seed = mix_seed(self.rollout_config.seed, _EVAL_SEED)
        return list(self.tasks.eval_rows(self.config.eval_size * world, seed=seed))[self.groups.rank :: world]

    def scored_evaluation(self, rows: list[object]) -> Rollout:
        """This rank's evaluation rollout of `rows`, scored (collective over the rollout group only)."""
        rollout = self.tasks.evaluate(self.rollouter, rows, self.step)
        totals, _ = self.rewards.score(rollout.trajectories, rollout.rows, step=self.step)
        self.rewards.take_metrics()  # what they log while evaluating is not the next step's
        self.score(rollout.trajectories, totals)
        return rollout

    def completions(self, rollout: Rollout) -> list[dict]:
        """A few of this rank's trajectories as text, for completions.jsonl."""
        assert rollout.advantages is not None  # set by scored_rollout
        out = []
        for t, a in list(zip(rollout.trajectories, rollout.advantages.tolist()))[
            : self.config.log_completions
        ]:
            out.append(
                {
                    "conversation": t.infos.conversation,
                    "seat": t.participant,
                    "reward": t.reward,  # set by score()
                    "advantage": a,
                    "status": t.status.value,
                    "stop_reason": t.infos.stop_reason,  # a failed sample's cause
                    "finish_reasons": [s.finish_reason for s in t.turns],
                    "text": self.tokenizer.decode(t.token_ids),
                }
            )
        return out

    # -- checkpoints --------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.output_dir / "checkpoints"

    def resume(self) -> int:
        """Continue from the newest intact checkpoint, if any; returns the step to start from."""
        self.resumed = True
        return state.resume(self)

    def export_hf(self, out_dir: str | Path) -> Path:
        return self.backend.export_hf(out_dir)

    def close(self) -> None:
        """The run's last call before the process groups go (see `Backend.close`)."""
        self.backend.close()
