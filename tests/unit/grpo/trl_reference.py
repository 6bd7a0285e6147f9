"""TRL 1.16's GRPO loss (`GRPOTrainer._compute_loss`) run on given tensors, for comparisons.

The trainer object is replaced by a namespace holding only what `_compute_loss` reads: the
model forward returns the given logprobs and entropies, the accelerator is one process.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch


class _OneProcess:
    num_processes = 1
    sync_gradients = True

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(
    loss_type: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    entropies: torch.Tensor | None = None,
    level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float = 0.2,
    top_entropy_quantile: float = 1.0,
    entropy_coef: float = 0.0,
    **args,
) -> torch.Tensor:
    """TRL's loss of `logprobs` [B, T] (a leaf that gets its gradient), advantages [B]."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer
    ent = torch.zeros_like(logprobs) if entropies is None else entropies
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, ent, None),
        top_entropy_quantile=top_entropy_quantile,
        accelerator=_OneProcess(),
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=0.0,
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1, **args),
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=entropy_coef != 0.0,
        entropy_coef=entropy_coef,
        use_adaptive_entropy=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    trainer.get_high_entropy_mask = lambda *a: grpo.get_high_entropy_mask(trainer, *a)
    b, t = logprobs.shape
    inputs = {
        "prompt_ids": torch.zeros(b, 0, dtype=torch.long),
        "prompt_mask": torch.zeros(b, 0, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old_logprobs,
        "num_items_in_batch": mask.sum().float(),
    }
    return grpo._compute_loss(trainer, None, inputs)
