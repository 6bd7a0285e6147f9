"""The learning rate of each step: a linear warmup to `TrainerConfig.lr`, then constant or decaying.

A pure function of the step (not an optimizer-side scheduler with state of its own): both
backends set it before each step's updates, a resumed run continues the same curve from its
step, and nothing extra goes into a checkpoint. Steps are the run's steps (rollouts): with
`--updates-per-rollout K` the K updates of a step share its learning rate.

    warmup   = --warmup-steps, or ceil(--warmup-ratio x --steps)
    step < warmup:   lr x (step + 1) / warmup          (never 0: every step learns something)
    afterwards:      lr (constant), lr x (1 - p) (linear), lr x (1 + cos(pi p)) / 2 (cosine),
                     p = (step - warmup) / (steps - warmup), which stays below 1 within the run
"""

from __future__ import annotations

import math

from .config import TrainerConfig


def warmup_steps(cfg: TrainerConfig) -> int:
    return cfg.warmup_steps or math.ceil(cfg.warmup_ratio * cfg.steps)


def lr_at(step: int, cfg: TrainerConfig) -> float:
    """The learning rate of (0-based) `step` of a run of `cfg.steps` steps."""
    warmup = warmup_steps(cfg)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_scheduler_type == "constant":
        return cfg.lr
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    if cfg.lr_scheduler_type == "linear":
        return cfg.lr * max(0.0, 1.0 - progress)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
