"""Engines: what turns rows of prompt ids into sampled continuations.

- `base`: the `Engine` protocol, `SamplingParams`, `GenerationRequest`, `Generation`, and the
  checks of sampling settings;
- `sampler`: the sampling kernels (seeded Gumbel draws, filters, penalties), batch- and
  TP-invariant;
- `hf`: `HFEngine` (the `transformers` model being trained); `prefix_cache`:
  `PrefixCachingEngine`; `vllm`: `VLLMEngine` colocated in the training ranks; `weight_sync`:
  trained weights into vLLM.

Megatron's own engine is `interlens_mcore.megatron.engine`.
"""
