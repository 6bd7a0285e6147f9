"""GRPO's tensors: rewards, group advantages, training batches, per-token logprobs, and `loss/`.

Pure functions: tensors in, tensors and metrics out; global denominators come from the caller.
"""
