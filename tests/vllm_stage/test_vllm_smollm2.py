"""SmolLM2-135M-Instruct generates through vLLM as through HFEngine (same greedy answer).

The model folder is built on first use (`ensure_smollm2`, cached in $INTERLENS_ASSETS; the main
test stage usually has built it already).
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here; its tests run in the environment .ci/vllm_stage.sh builds"
)

from interlens_mcore import GenerationRequest  # noqa: E402
from interlens_mcore.engines.vllm import VLLMConfig, VLLMEngine  # noqa: E402


def test_vllm_answers_as_the_hf_engine(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    request = GenerationRequest(
        prompt_ids=prompt, max_new_tokens=16, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,)
    )
    config = VLLMConfig(colocated=False, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    (out,) = VLLMEngine.create(str(smollm2_path), config).generate([request])
    assert "Paris" in tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert len(out.logprobs) == len(out.token_ids)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    (hf,) = HFEngine(model, tokenizer).generate([request])
    # greedy in float32 on both sides: the same ids (their logprobs agree within rounding)
    assert out.token_ids == hf.token_ids
    assert max(abs(a - b) for a, b in zip(out.logprobs, hf.logprobs, strict=True)) < 1e-3
