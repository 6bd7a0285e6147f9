"""`--engine vllm` builds vLLM in the trainer's dtype unless told otherwise (vLLM's own "auto" is the
checkpoint's, bfloat16 for most released models, while the trainer computes in float32)."""

from __future__ import annotations

import pytest

from trainers.backends.colocated_vllm import vllm_config
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
