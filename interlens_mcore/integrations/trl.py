"""This package's lockstep multi-turn rollouts inside TRL's `GRPOTrainer` (TRL 1.16).

A TRL user's whole script::

    from trl import GRPOConfig, GRPOTrainer
    from interlens_mcore.integrations.trl import TRLRollouts, env_reward
    from interlens_mcore.tasks import resolve_task

    rollouts = TRLRollouts(resolve_task("guess"))
    trainer = GRPOTrainer(model, reward_funcs=env_reward, args=GRPOConfig(num_generations=4, ...),
                          train_dataset=rollouts.dataset(64), rollout_func=rollouts)
    trainer.train()

The seam is `rollout_func`, TRL's white-box hook, and not a `RolloutMixin` subclass of
`GRPOTrainer`: the hook is called on every backend (HF generation as well as vLLM), receives
the trainer, and takes everything a multi-turn rollout produces (`env_mask`, logprobs, extra
reward columns) without overriding any private method, so no TRL internals are patched or
shadowed and a TRL upgrade can only break the documented contract. The generation runs on the
trainer's own model (unwrapped from accelerate's DDP, our `HFEngine`) and tokenizer; TRL's
vLLM is not used, because its `VLLMGeneration` takes TRL's single-turn prompts and sampling
settings, not our per-row caps and seeds, so wiring it in is not a thin change.

What TRL gets for each prompt it passes (one sample each: TRL's sampler already repeats every
dataset row `num_generations` times, consecutively, so returning one sample per prompt in
order keeps TRL's grouping; its docstring says the slice is not repeated, its 1.16 code passes
one prompt per rollout):
- `prompt_ids`: the trajectory's tokens before the policy's first sampled token;
- `completion_ids`: every token after, environment replies included;
- `env_mask`: our loss mask over `completion_ids` (1 only on sampled policy tokens);
- `logprobs`: one per completion token, our engine's at sampled tokens and 0.0 elsewhere, as
  TRL's own tool loop fills tool-result tokens (TRL multiplies by the mask or maps NaN to 0
  before every use, so the value at a masked position never reaches the loss);
- `env_reward`, `success`, `turns`, `env_infos`: extra columns its reward functions read
  (`env_reward` below returns the first).

Rows come from any `TaskSource` (toy games, reasoning-gym, gymnasium, textarena, ms-swift
schedulers, agents, verifiers): `dataset(n)` draws them and tags each prompt message with the
row's number (`task_row`), by which `__call__` finds the row again, because TRL passes the
rollout function prompts only. Under several processes (torchrun, accelerate) the termination
vote rides the world's process group (`distributed.build_groups(rollout="world")`), so ranks
needing different numbers of turns keep voting until all are done, and one rank's environment
error is raised on every rank with its message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import distributed
from ..engines.hf import HFEngine
from ..rollout.rollouter import RolloutConfig, Rollouter, Task
from ..tasks.base import TaskSource
from ..types import ChatMessage, Trajectory

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = ["ROW_KEY", "TRLRollouts", "env_reward", "trl_fields"]

ROW_KEY = "task_row"  # the prompt messages' key naming the task source's row


def env_reward(completions: Sequence[object], env_reward: Sequence[float], **_: object) -> list[float]:
    """A TRL reward function: the environment's own reward of each rollout (`TRLRollouts`'s column)."""
    return [float(r) for r in env_reward]


def trl_fields(trajectories: Sequence[Trajectory]) -> dict[str, list[Any]]:
    """What TRL's `rollout_func` returns for these trajectories, one entry each, in order."""
    out: dict[str, list[Any]] = {
        k: []
        for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "env_reward", "success", "turns")
    }
    out["env_infos"] = []
    for t in trajectories:
        if 1 not in t.loss_mask:
            raise ValueError(
                f"trajectory of {t.infos.conversation!r} ({t.status.value}) has no policy token: TRL needs "
                "a completion for every prompt"
            )
        split = t.loss_mask.index(1)  # the first prompt ends where the policy first speaks
        mask = t.loss_mask[split:]
        sampled = iter(t.rollout_logprobs if t.logprobs_complete and t.rollout_logprobs else [])
        logprobs = [next(sampled, 0.0) if m else 0.0 for m in mask]
        out["prompt_ids"].append(t.token_ids[:split])
        out["completion_ids"].append(t.token_ids[split:])
        out["env_mask"].append(mask)
        out["logprobs"].append(logprobs)
        out["env_reward"].append(float(t.infos.env_reward or 0.0))
        out["success"].append(t.infos.success)
        out["turns"].append(t.infos.turns)
        out["env_infos"].append(
            {"status": t.status.value, "stop_reason": t.infos.stop_reason, **t.infos.extra}
        )
    return out


class TRLRollouts:
    """A `rollout_func` for `trl.GRPOTrainer` over one task source (see the module docstring).

    `config` sets the turns' sampling (`max_new_tokens` per policy turn, temperature, time
    limits); its `num_generations` must stay 1, because TRL repeats the prompts itself.
    `on_sample_error` defaults to "raise": TRL has no way to leave a failed sample out.
    """

    def __init__(self, source: TaskSource, *, config: RolloutConfig | None = None, seed: int = 0):
        self.source, self.seed = source, seed
        self.config = config or RolloutConfig(num_generations=1, on_sample_error="raise")
        if self.config.num_generations != 1:
            raise ValueError(
                f"TRLRollouts config.num_generations is {self.config.num_generations}; it must be 1: set "
                "GRPOConfig.num_generations instead (TRL repeats each prompt that many times)"
            )
        self._rows: list[object] = []
        self._rollouter: Rollouter | None = None

    def dataset(self, n: int) -> Dataset:
        """`n` rows of the source as a TRL prompt dataset (column `prompt`, messages tagged with the row)."""
        from datasets import Dataset

        self._rows = list(self.source.rows(n, seed=self.seed))
        return Dataset.from_list(
            [{"prompt": [{**m, ROW_KEY: i} for m in _chat_prompt(row)]} for i, row in enumerate(self._rows)]
        )

    def rollouter(self, trainer: Any) -> Rollouter:
        """Our rollouter over the trainer's unwrapped model and tokenizer (collective the first time)."""
        if self._rollouter is None:
            model = trainer.accelerator.unwrap_model(trainer.model)
            tokenizer = trainer.processing_class
            self._rollouter = Rollouter(
                engine=HFEngine(model, tokenizer),
                tokenizer=tokenizer,
                groups=distributed.build_groups(rollout="world"),
                config=dataclasses.replace(self.config, seed=self.seed),
            )
        return self._rollouter

    def rows_of(self, prompts: Sequence[Sequence[ChatMessage]]) -> list[object]:
        """The source's rows that `prompts` (TRL's, from `dataset`) were drawn from."""
        rows = []
        for p in prompts:
            row = p[0].get(ROW_KEY) if p and isinstance(p[0], dict) else None
            if not isinstance(row, int) or not 0 <= row < len(self._rows):
                raise ValueError(
                    f"prompt {str(p)[:80]!r} carries no row of this TRLRollouts ({ROW_KEY!r} in its "
                    "messages): train on TRLRollouts.dataset(n)"
                )
            rows.append(self._rows[row])
        return rows

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """TRL's `rollout_func(prompts, trainer)`: one multi-turn sample per prompt (collective)."""
        rows = self.rows_of(prompts)
        rollout = self.source.run(self.rollouter(trainer), rows, int(trainer.state.global_step))
        if len(rollout.trajectories) != len(prompts):
            raise ValueError(
                f"task source {self.source.name!r} gave {len(rollout.trajectories)} trajectories for "
                f"{len(prompts)} prompts: TRL trains one seat per prompt (trained_seats "
                f"{self.source.trained_seats})"
            )
        return trl_fields(rollout.trajectories)


def _chat_prompt(row: object) -> list[dict[str, object]]:
    """The row's opening transcript as chat messages (a Task's prompt, or a scheduler row's messages)."""
    if isinstance(row, Task):
        return [{"role": m.role, "content": m.content} for m in row.prompt()]
    messages = row.get("messages") if isinstance(row, dict) else row
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    raise ValueError(
        f"row {type(row).__name__} is neither a Task nor a message list (or a dict with 'messages'): "
        "TRLRollouts cannot show it to TRL as a prompt"
    )
