"""Reward functions beyond the task's own: scored by models (`model`, `judge`)."""
