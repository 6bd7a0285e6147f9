"""`--engine vllm` builds vLLM in the trainer's dtype unless told otherwise (vLLM's own "auto" is the
checkpoint's, bfloat16 for most released models, while the trainer computes in float32)."""

from __future__ import annotations

import pytest

from interlens_mcore.engines.vllm import VLLMConfig, vllm_lora_rank
from trainers.backends.colocated_vllm import lora_sync, vllm_config
from trainers.config import BackendConfig


@pytest.mark.parametrize(
    "options, dtype",
    [
        ({}, "float32"),
        ({"bf16": True}, "bfloat16"),
        ({"vllm_dtype": "bfloat16"}, "bfloat16"),
        ({"bf16": True, "vllm_dtype": "float32"}, "float32"),
    ],
)
def test_vllm_computes_in_the_trainers_dtype_by_default(options, dtype):
    config = vllm_config(BackendConfig(engine="vllm", **options), tp=2)
    assert config is not None and config.dtype == dtype and config.tensor_parallel_size == 2
    assert config.llm_kwargs()["dtype"] == dtype


def test_the_native_engine_builds_no_vllm():
    assert vllm_config(BackendConfig(), tp=1) is None


@pytest.mark.parametrize(
    "options, sync, max_lora_rank",
    [
        ({"backend": "megatron"}, "merged", 0),  # auto on megatron: merged weights, vLLM's plain model
        ({"backend": "megatron", "vllm_lora": "adapter"}, "adapter", 8),
        ({"backend": "deepspeed"}, "adapter", 8),  # auto on deepspeed: peft's adapters
    ],
)
def test_lora_reaches_vllm_merged_or_through_its_lora_path(options, sync, max_lora_rank):
    cfg = BackendConfig(engine="vllm", lora_rank=8, **options)
    assert lora_sync(cfg) == sync
    config = vllm_config(cfg, tp=1)
    assert config is not None and config.max_lora_rank == max_lora_rank
    kwargs = config.llm_kwargs()
    assert kwargs.get("enable_lora", False) is (sync == "adapter")
    if sync == "adapter":
        assert kwargs["max_lora_rank"] == 8 and kwargs["max_loras"] == 1


@pytest.mark.parametrize("rank, allowed", [(1, 1), (4, 8), (8, 8), (12, 16), (100, 128), (512, 512)])
def test_vllm_is_given_the_smallest_lora_rank_it_accepts(rank, allowed):
    assert vllm_lora_rank(rank) == allowed


def test_a_lora_rank_vllm_cannot_hold_is_refused_by_name():
    with pytest.raises(
        ValueError, match="max_lora_rank 600: vLLM's LoRA path takes adapters of rank up to 512"
    ):
        VLLMConfig(max_lora_rank=600)


def test_no_lora_sync_without_lora_or_vllm():
    assert lora_sync(BackendConfig(engine="vllm")) is None
    assert lora_sync(BackendConfig(lora_rank=8, backend="deepspeed")) is None
