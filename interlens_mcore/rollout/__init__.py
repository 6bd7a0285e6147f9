"""Rollouts: conversations and schedulers played in lockstep rounds, into trajectories.

- `conversation`, `stop`: lineups of participants, their token-space views and stop conditions;
- `round`: the lockstep round both drivers run (local phase, vote, aligned engine calls), with
  `vote` (one rank's failure on every rank) and `limits` (per-step time limits);
- `costep`: `co_step` for lineups; `scheduler`, `results`, `multiturn`: `run_multi_turn` for
  `MultiTurnScheduler`s;
- `rollouter`: rows x generations into a scored `Rollout`; `mixin`: `RolloutMixin` for trainers
  that are not ours.

The public names are exported from `interlens_mcore`; this package's `__init__` imports nothing,
so importing one of its modules never imports the others.
"""
