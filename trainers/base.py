"""`GRPOTrainer`: the outer loop shared by the backends, and the methods a custom trainer overrides.

One step::

    rows     = self.rows_for_step(step)                # data position = the step number
    rollout  = self.generate_rollouts(rows, step)      # RolloutMixin: rollout, reward, advantages
    metrics  = self.train_on(rollout)                  # micro-batches, GRPO loss, optimizer step
    self.log_step(...); self.maybe_save(step + 1)

A backend implements `logprobs_of`, `policy_logprobs`, `backward`, `optimizer_step`,
`save_state` and `load_state`. A custom trainer usually overrides `compute_rewards`,
`build_conversation` (the lineup), `scheduler`, `rows_for_step` or `loss`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from interlens_mcore import parallel
from interlens_mcore.batch import TrainingBatch, build_batch
from interlens_mcore.conversation import Policy
from interlens_mcore.engine import Engine
from interlens_mcore.envs import ENVS, OPPONENTS, fixed_opponent_tasks, make_tasks
from interlens_mcore.loss import LossConfig, batch_loss, finalize_metrics, merge_metrics
from interlens_mcore.mixin import Rollout, RolloutConfig, RolloutMixin
from interlens_mcore.sampling import mix_seed
from interlens_mcore.trajectory import Trajectory

from . import checkpoint
from .metrics_log import MetricsLog


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The outer loop and optimizer."""

    steps: int = 60
    prompts_per_rank: int = 4  # rows per rank per step; each becomes num_generations samples
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    updates_per_rollout: int = 1  # optimizer steps per rollout batch (> 1: old logprobs recomputed)
    save_every: int = 10  # steps between checkpoints (the last step is always saved)
    seed: int = 0
    output_dir: str = "runs/grpo"
    env: str = "guess"  # rows of `rows_for_step`: an environment of interlens_mcore.envs
    opponent: str = "self"  # multi-seat games: player_b is the trained policy, random or frozen
    max_guesses: int = 3  # guess: guesses per game
    eval_every: int = 10  # steps between games against a fixed random opponent (0: never)
    eval_games: int = 16  # per rank and seat

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "prompts_per_rank",
            "updates_per_rollout",
            "save_every",
            "max_guesses",
            "eval_games",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"TrainerConfig.lr must be > 0, got {self.lr}")
        if self.env not in ENVS:
            raise ValueError(f"TrainerConfig.env must be one of {ENVS}, got {self.env!r}")
        if self.opponent not in OPPONENTS:
            raise ValueError(f"TrainerConfig.opponent must be one of {OPPONENTS}, got {self.opponent!r}")
        if self.opponent != "self" and self.env != "duel":
            raise ValueError(f"TrainerConfig.opponent {self.opponent!r} needs a multi-seat env ('duel')")
        if self.eval_every < 0:
            raise ValueError(f"TrainerConfig.eval_every must be >= 0, got {self.eval_every}")


class GRPOTrainer(RolloutMixin, ABC):
    """GRPO on multi-turn rollouts; subclasses supply the model backend."""

    def __init__(
        self,
        *,
        config: TrainerConfig,
        rollout_config: RolloutConfig,
        loss_config: LossConfig,
        groups: parallel.ParallelGroups,
        tokenizer: Any,
        run_info: dict | None = None,
    ):
        self.config, self.rollout_config, self.loss_config = config, rollout_config, loss_config
        self.groups, self.tokenizer = groups, tokenizer
        self.run_info = run_info or {}
        self.output_dir = Path(config.output_dir)
        self._frozen_policy: Policy | None = None  # opponent="frozen": player_b, built on first use
        self.step = 0
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite gradient norm, ever

    # -- backend ------------------------------------------------------------------------------
    @abstractmethod
    def policy_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        """[B, T] logprobs of batch.targets under the trained model, with gradient."""

    @abstractmethod
    def logprobs_of(self, model: torch.nn.Module, batch: TrainingBatch) -> torch.Tensor:
        """[B, T] logprobs of batch.targets under `model` (the trained one or the reference)."""

    reference: torch.nn.Module | None = None  # frozen reference model for the KL term

    def reference_logprobs(self, batch: TrainingBatch) -> torch.Tensor | None:
        """[B, T] logprobs under the frozen reference model, or None when there is none."""
        if self.reference is None:
            return None
        with torch.no_grad():
            return self.logprobs_of(self.reference, batch)

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def optimizer_step(self) -> float:
        """Clip, step, zero the gradients; returns the global gradient norm (collective).

        The norm is over the whole model: every TP shard, after the DP average. When it is not
        finite (NaN or inf) the step is NOT applied: the gradients are zeroed, weights and
        optimizer state stay untouched, and the norm is returned as is so the caller counts the
        skip. Every rank must reach the same decision, which holds because every rank returns
        the same global norm.
        """

    @abstractmethod
    def save_state(self, folder: Path) -> None:
        """Write model and optimizer state of this rank into `folder` (collective)."""

    @abstractmethod
    def load_state(self, folder: Path) -> None: ...

    # -- data -----------------------------------------------------------------------------------
    def rows_for_step(self, step: int) -> list[Any]:
        """This rank's rows: a pure function of (seed, step, rank), so resuming replays them."""
        cfg = self.config
        seed = mix_seed(cfg.seed, step, self.groups.rank)
        # a frozen opponent's seat stays a policy seat in the task; `seat_policy` freezes it
        return make_tasks(
            cfg.env, cfg.prompts_per_rank, seed=seed, opponent=cfg.opponent, max_guesses=cfg.max_guesses
        )

    # -- seats ----------------------------------------------------------------------------------
    FROZEN_SEAT = "player_b"  # the seat `opponent="frozen"` gives to the initial weights

    def seat_policy(self, name: str) -> Policy:
        if self.config.opponent != "frozen" or name != self.FROZEN_SEAT:
            return super().seat_policy(name)
        if self._frozen_policy is None:
            self._frozen_policy = Policy(
                name=name,
                engine=self.frozen_engine(),
                tokenizer=self.tokenizer,
                sampling=self.rollout_config.sampling,
                trainable=False,
            )
        return self._frozen_policy

    def extra_engines(self) -> list[Any]:
        return [self.frozen_engine()] if self.config.opponent == "frozen" else []

    def frozen_engine(self) -> Engine:
        """An engine over the initial weights, never trained (a frozen opponent's)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no frozen engine; use opponent 'self' or 'random'"
        )

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> list[dict]:
        """Run (or continue) to `config.steps`; returns the metrics of the steps run here."""
        log = MetricsLog(
            self.output_dir, total=self.config.steps, start=self.step, enabled=self.groups.rank == 0
        )
        records = []
        try:
            while self.step < self.config.steps:
                t0 = time.perf_counter()
                rollout = self.generate_rollouts(self.rows_for_step(self.step), self.step)
                t1 = time.perf_counter()
                train_metrics = self.train_on(rollout)
                t2 = time.perf_counter()
                record = self.step_record(rollout, train_metrics, rollout_s=t1 - t0, train_s=t2 - t1)
                record.update(self.evaluation(self.step))
                log.log(record)
                records.append(record)
                self.step += 1
                if self.step % self.config.save_every == 0 or self.step == self.config.steps:
                    self.save_checkpoint()
        finally:
            log.close()
        return records

    def evaluation(self, step: int) -> dict[str, float]:
        """Games against a fixed random opponent every `eval_every` steps (and at the last step).

        Collective over the world; `eval/win_rate/<seat>` counts a tie as half a win. Empty for
        single-seat environments and between evaluations.
        """
        cfg = self.config
        due = cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps - 1)
        seed = mix_seed(cfg.seed, step, self.groups.rank, 0x65)
        rows = fixed_opponent_tasks(cfg.env, cfg.eval_games, seed=seed) if due else []
        if not rows:
            return {}
        scores: dict[str, list[float]] = {}
        for part in parallel.all_gather_object(self.evaluate(rows, step)):
            for key, values in part.items():
                scores.setdefault(key, []).extend(values)
        return {f"eval/{k}": sum(v) / len(v) for k, v in sorted(scores.items())}

    def train_on(self, rollout: Rollout) -> dict[str, float]:
        """`updates_per_rollout` optimizer steps on this rollout; returns the finalized metrics."""
        batches = self.training_batches(rollout)
        placeholder = self._placeholder(rollout)
        counts = torch.tensor(
            [sum(b.num_loss_tokens for b in batches if b), sum(b.num_samples for b in batches if b)],
            dtype=torch.float64,
        )
        # global denominators: the loss of every micro-batch on every DP rank sums to the mean
        num_tokens, num_sequences = parallel.all_reduce(counts, group=self.groups.dp).tolist()
        if num_tokens == 0:  # nothing trainable anywhere (e.g. every group dropped)
            return {"grad_norm": 0.0, "skipped": 1.0, "step_skipped": 0.0}
        old = None
        if self.config.updates_per_rollout > 1:
            with torch.no_grad():
                old = [self.policy_logprobs(b).detach() if b else None for b in batches]
        refs = [self.reference_logprobs(b) if b else None for b in batches]
        skipped = 0
        for _ in range(self.config.updates_per_rollout):
            sums = None
            for i, batch in enumerate(batches):
                real = batch is not None
                mb = batch if real else placeholder
                lp = self.policy_logprobs(mb)
                kwargs = dict(
                    old_logprobs=old[i] if old and real else None, ref_logprobs=refs[i] if real else None
                )
                if not real and self.loss_config.beta > 0:
                    kwargs["ref_logprobs"] = lp.detach()
                loss, metrics = self.loss(
                    lp, mb, num_tokens=num_tokens, num_sequences=num_sequences, **kwargs
                )
                # a rank with no rows still joins the gradient all-reduce, contributing zero
                loss = loss if real else loss * 0.0
                if not torch.isfinite(loss.detach()):
                    # A non-finite loss need not give non-finite gradients (a NaN added to the
                    # loss has gradient 0). Scaled by NaN, every gradient that depends on the
                    # parameters becomes NaN, even a zero one, and the DP all-reduce spreads it
                    # to every rank, so the backend's one check of the global norm skips the
                    # step everywhere together.
                    loss = loss * float("nan")
                self.backward(loss)
                if real:
                    sums = metrics if sums is None else merge_metrics(sums, metrics)
            grad_norm = self.optimizer_step()
            # the backend did not apply this update (see optimizer_step): count it
            skipped += not math.isfinite(grad_norm)
        self.skipped_steps += skipped
        metrics = self._reduce_metrics(sums)
        return {**metrics, "grad_norm": grad_norm, "step_skipped": float(skipped > 0)}

    def loss(self, logprobs: torch.Tensor, batch: TrainingBatch, **kwargs) -> tuple[torch.Tensor, dict]:
        """The GRPO loss of one micro-batch (already divided by the global denominators)."""
        return batch_loss(logprobs, batch, self.loss_config, **kwargs)

    def _placeholder(self, rollout: Rollout) -> TrainingBatch:
        # stands in for an empty micro-batch so collectives stay aligned; its loss is scaled by 0
        first = next(t for t in rollout.trajectories if t.num_trained_tokens > 0)
        cfg = self.rollout_config
        return build_batch([first], [0.0], layout=cfg.layout, pad_to_multiple=cfg.pad_to_multiple)

    def _reduce_metrics(self, sums: dict | None) -> dict[str, float]:
        """Sum (max for '/max') the loss metric sums over the DP group, then finalize."""
        if sums is None:  # this rank had nothing; its zeros still join the reductions
            sums = _zero_metrics()
        keys = sorted(sums)
        plain = torch.stack([sums[k].double() for k in keys if not k.endswith("/max")])
        peak = torch.stack([sums[k].double() for k in keys if k.endswith("/max")])
        parallel.all_reduce(plain, "sum", self.groups.dp)
        parallel.all_reduce(peak, "max", self.groups.dp)
        merged = dict(zip([k for k in keys if not k.endswith("/max")], plain.tolist()))
        merged.update(zip([k for k in keys if k.endswith("/max")], peak.tolist()))
        return finalize_metrics(merged)

    def step_record(self, rollout: Rollout, m: dict[str, float], *, rollout_s: float, train_s: float) -> dict:
        """The metrics.jsonl line: rewards over every DP rank, loss and IS figures, timings."""
        # one gather: rewards in rank order, per-seat rewards and timeouts of every DP rank
        parts = parallel.all_gather_object(
            (rollout.rewards, rollout.seat_rewards(), rollout.timeouts), group=self.groups.dp
        )
        rewards = torch.cat([p[0] for p in parts])
        turns = [t.infos.get("turns", 0) for t in rollout.trajectories]
        record = {
            "step": self.step,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "loss": m.get("loss/policy", 0.0) + m.get("loss/kl", 0.0),
            "kl": m.get("kl/ref", 0.0),
            "is_kl_k3": m.get("is/kl_k3", 0.0),
            "is_sample_fraction": m.get("is/sample_fraction", 0.0),
            "is_weight_mean": m.get("is/weight_mean", 0.0),
            "is_weight_max": m.get("is/weight/max", 0.0),
            "clip_fraction": m.get("clip/fraction", 0.0),
            "grad_norm": m["grad_norm"],
            "step_skipped": int(m["step_skipped"]),  # 1: a non-finite gradient norm skipped the update
            "skipped_steps": self.skipped_steps,  # optimizer updates skipped so far in the run
            "tokens": int(m.get("tokens", 0.0)),
            "turns_mean": sum(turns) / max(1, len(turns)),
            "rollout_s": round(rollout_s, 3),
            "train_s": round(train_s, 3),
        }
        seats: dict[str, list[float]] = {}
        for _, part_seats, _ in parts:
            for seat, values in part_seats.items():
                seats.setdefault(seat, []).extend(values)
        record["timeouts"] = sum(p[2] for p in parts)  # samples a step time limit ended (on_timeout)
        if len(seats) > 1:  # several trained seats: each seat's own mean
            record.update({f"reward_mean/{k}": sum(v) / len(v) for k, v in sorted(seats.items())})
        # JSON has no NaN or inf: a non-finite figure (the loss of a skipped step) is written null
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}

    # -- checkpoints ------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.output_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        def write(folder: Path) -> None:
            self.save_state(folder)
            state = {"step": self.step, "rng": checkpoint.rng_state(), "skipped_steps": self.skipped_steps}
            torch.save(state, folder / f"trainer-rank{self.groups.rank:05d}.pt")

        return checkpoint.save(self.checkpoint_root, self.step, write, meta={"run": self.run_info})

    def resume(self) -> int:
        """Load the newest intact checkpoint, if any; returns the step to continue from.

        Rank 0 verifies the checkpoints newest first against their manifests and renames a
        corrupt one to `corrupt-step-NNNNNN` (kept for inspection, never chosen again); every
        rank then loads the one it chose. `checkpoint.NoIntactCheckpoint` (a ValueError) on every
        rank when checkpoints exist but none is intact.
        """
        root = self.checkpoint_root
        choice: tuple[str | None, str | None] = (None, None)  # (folder name, error)
        if parallel.rank() == 0:
            checkpoint.clean_stale(root)
            choice = _choose_checkpoint(root)
        # everyone loads the same step, or everyone raises
        name, error = parallel.all_gather_object(choice)[0]
        if error is not None:
            raise checkpoint.NoIntactCheckpoint(error)
        if name is None:
            return self.step
        folder = root / name
        self.load_state(folder)
        state = torch.load(folder / f"trainer-rank{self.groups.rank:05d}.pt", weights_only=False)
        checkpoint.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        return self.step


def _choose_checkpoint(root: Path) -> tuple[str | None, str | None]:
    """(newest intact checkpoint's name or None, error or None); says why on stderr (rank 0)."""
    good, bad = checkpoint.newest_intact(root)
    then = f"resuming from {good.name}" if good is not None else "no intact checkpoint is left"
    for name, reason, kept in bad:
        print(f"checkpoint {name} is corrupt ({reason}), kept as {kept}; {then}", file=sys.stderr)
    set_aside = checkpoint.corrupt(root)  # this run's and earlier runs' corrupt checkpoints
    if good is None and set_aside:
        return None, (
            f"no intact checkpoint in {root} to resume from; set aside as corrupt: "
            f"{', '.join(set_aside)} (inspect or remove them, or start without --resume)"
        )
    return (good.name if good is not None else None), None


def _zero_metrics() -> dict[str, torch.Tensor]:
    """The metric keys of `grpo_loss`, all zero (for a rank that trained on nothing)."""
    t = Trajectory(token_ids=[0, 1], loss_mask=[0, 1], rollout_logprobs=None)
    b = build_batch([t], [0.0])
    _, m = batch_loss(torch.zeros(b.input_ids.shape), b, LossConfig(), num_tokens=1, num_sequences=1)
    return {k: torch.zeros(()) for k in m}


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)
