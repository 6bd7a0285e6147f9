"""Adapters that put this package's rollouts inside other projects' trainers.

Each module imports its project lazily, so `import interlens_mcore` never needs it:
- `trl`: a `rollout_func` for TRL's `GRPOTrainer` (`TRLRollouts`, `env_reward`).
"""
