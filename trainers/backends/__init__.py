"""Training backends behind the `Backend` protocol (`base`): `megatron` (megatron-core GPTModel,
TP x DP) and `deepspeed` (an HF model under ZeRO 1/2/3), each optionally with a colocated vLLM
(`colocated_vllm`); `factory.build_backend` builds the one a `BackendConfig` names.

`megatron` and `deepspeed` import their frameworks lazily; this `__init__` imports nothing.
"""
