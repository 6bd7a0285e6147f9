"""Training backends behind the `Backend` protocol (`base`): `megatron` (megatron-core GPTModel,
TP x DP) and `deepspeed` (an HF model under ZeRO 1/2/3), each optionally with a colocated vLLM
(`colocated_vllm`). `registry.BACKENDS` names them (one line each: docs/guide.md, "Adding a
backend"); `factory.build_backend` builds the one a `BackendConfig` names, through its module's `build`.

`megatron` and `deepspeed` import their frameworks lazily; this `__init__` imports nothing.
"""
