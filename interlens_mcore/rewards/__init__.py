"""Reward functions as TRL and ms-swift users write them, and built-ins by name.

`adapt(obj)` turns a reward function of any of the three conventions into ours
(`interlens_mcore.grpo.rewards.RewardFn`, `fn(trajectories, rows)`); `named(names, ...)`
resolves `--reward-funcs NAME ...` from the plugin files' `orms` dicts and the built-ins
(`builtins.BUILTINS`). docs/rewards.md shows each convention with an example. Rewards scored
by models: `model.RewardModel` (`--reward-model`) and `judge.Judge` (`--judge-model`),
docs/reward-models.md.
"""

from .conventions import Convention, adapt, convention_of
from .registry import named

__all__ = ["Convention", "adapt", "convention_of", "named"]
