"""interlens_mcore: multi-turn, multi-party colocated rollouts for GRPO."""
