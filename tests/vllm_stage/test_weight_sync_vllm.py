"""Weights reach a colocated vLLM from both training backends, on 2 gloo ranks (2 x vLLM TP=1);
megatron's LoRA adapters reach it merged, or alone through vLLM's LoRA path.

After the update, vLLM's greedy tokens are those of the HF model holding the same weights:
from a megatron-core GPTModel at TP=2 (shards gathered, fused QKV / gate-up split back; the
tiny Llama's vocabulary of 515 is padded at TP=2) and from an HF model under DeepSpeed ZeRO-3
after a real optimizer step (parameters gathered; the tiny Qwen2 ties its embeddings).
"""

from __future__ import annotations

import pytest
from support.dist import run_ranks

pytest.importorskip(
    "vllm", reason="vLLM is not installed here; its tests run in the environment .ci/vllm_stage.sh builds"
)

PROMPTS = [list(range(5, 15)), list(range(40, 47)), [300, 301, 302]]


def _greedy(engine) -> list[list[int]]:
    from interlens_mcore import GenerationRequest

    rows = [GenerationRequest(prompt_ids=p, max_new_tokens=10, temperature=0.0) for p in PROMPTS]
    return [g.token_ids for g in engine.generate(rows)]


def _hf_greedy(path: str, state: dict) -> list[list[int]]:
    """Greedy tokens of an HF model built from `path`'s config holding `state`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import HFEngine

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return _greedy(HFEngine(model.eval(), AutoTokenizer.from_pretrained(path)))


def _vllm(path: str, max_lora_rank: int = 0):
    from interlens_mcore.engines.vllm import VLLMConfig, VLLMEngine

    config = VLLMConfig(
        tensor_parallel_size=1,
        dtype="float32",
        max_model_len=128,
        enable_prefix_caching=True,
        max_lora_rank=max_lora_rank,
    )
    return VLLMEngine.create(path, config)


def _megatron_job(rank, world, path):
    import torch
    from megatron.core import parallel_state

    from interlens_mcore.engines.weight_sync import megatron_hf_tensors
    from interlens_mcore.megatron import build_model, load_hf_weights, load_layout

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    layout = load_layout(path)
    model = build_model(layout, init_weights=False)
    load_hf_weights(model, layout, path)
    engine = _vllm(path)  # joins the torchrun world: one TP=1 vLLM per rank
    before = _greedy(engine)
    with torch.no_grad():  # a "training step" that moves every shard the same way on each rank
        for i, (_, p) in enumerate(sorted(model.named_parameters())):
            p.mul_(1.0 + 0.15 * ((i % 5) - 2))
    report = engine.update_weights(megatron_hf_tensors(model, layout))
    after = _greedy(engine)
    state = dict(megatron_hf_tensors(model, layout))
    return {"before": before, "after": after, "hf": _hf_greedy(path, state), "tensors": report.tensors}


def _megatron_lora_job(rank, world, path, adapter_dir, via):
    import torch
    from megatron.core import parallel_state
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import HFEngine
    from interlens_mcore.engines.weight_sync import megatron_hf_tensors
    from interlens_mcore.megatron import build_model, load_hf_weights, load_layout
    from interlens_mcore.megatron.convert import gather_adapter_state_dict
    from interlens_mcore.megatron.lora import LoRAOptions, attach, save_peft

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    layout = load_layout(path)
    model = build_model(layout, init_weights=False)
    load_hf_weights(model, layout, path)
    options = LoRAOptions(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "linear_fc1", "down_proj"))
    attach(model, layout, options)
    engine = _vllm(path, max_lora_rank=options.rank if via == "adapter" else 0)
    before = _greedy(engine)
    gen = torch.Generator().manual_seed(0)  # the same draws on both ranks: B's whole copies agree

    def train_and_sync(step: int):
        with torch.no_grad():  # "trained" adapters: B away from zero
            for name, p in sorted(model.named_parameters()):
                if name.endswith("lora_B.weight"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        adapters = gather_adapter_state_dict(model, layout)
        if via == "merged":
            report = engine.update_weights(megatron_hf_tensors(model, layout))
        else:  # each rank hands its own vLLM its own copy, as the trainer does
            report = engine.load_adapter(
                save_peft(f"{adapter_dir}-{step}-r{rank}", adapters, options, base_model=path)
            )
        after = _greedy(engine)
        if rank == 0:
            save_peft(f"{adapter_dir}-{step}", adapters, options, base_model=path)
        torch.distributed.barrier()
        base = AutoModelForCausalLM.from_pretrained(path)
        peft_model = PeftModel.from_pretrained(base, f"{adapter_dir}-{step}")
        return after, _greedy(HFEngine(peft_model.eval(), AutoTokenizer.from_pretrained(path))), report

    after, hf, report = train_and_sync(0)
    out = {"before": before, "after": after, "hf": hf, "tensors": report.tensors}
    if via == "adapter":  # a second update replaces the first adapter
        out["after2"], out["hf2"], _ = train_and_sync(1)
        out["adapter"] = engine.adapter.lora_int_id
    return out


def _zero3_job(rank, world, path):
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    from interlens_mcore.engines.weight_sync import zero3_hf_tensors

    model = AutoModelForCausalLM.from_pretrained(path)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "torch_adam": True}},
    }
    ds, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine = _vllm(path)
    before = _greedy(engine)
    ids = torch.tensor([list(range(5, 40))])
    loss = ds(input_ids=ids, labels=ids).loss
    ds.backward(loss)
    ds.step()
    report = engine.update_weights(zero3_hf_tensors(ds.module))
    after = _greedy(engine)
    state = dict(zero3_hf_tensors(ds.module))
    return {"before": before, "after": after, "hf": _hf_greedy(path, state), "tensors": report.tensors}


def _check(results):
    for r in results:
        assert r["after"] == r["hf"]  # vLLM generates what the HF model with those weights does
        assert r["after"] != r["before"]  # and the update changed what it generates
    assert results[0]["after"] == results[1]["after"]  # both ranks hold the same weights


def test_megatron_tp2_weights_reach_vllm():
    from interlens_mcore.assets import ensure_tiny_model

    path = ensure_tiny_model(arch="llama", vocab_size=515, tie_word_embeddings=False, initializer_range=0.1)
    results = run_ranks(_megatron_job, 2, str(path), timeout=600)
    _check(results)
    assert results[0]["tensors"] == 2 + 1 + 2 * 9  # embeddings, lm_head, final norm, 9 per layer


def _tiny_llama():
    from interlens_mcore.assets import ensure_tiny_model

    return ensure_tiny_model(arch="llama", vocab_size=515, tie_word_embeddings=False, initializer_range=0.1)


def test_megatron_lora_tp2_merged_weights_reach_vllm(tmp_path):
    # vLLM generates with the merged weights what peft's model with the exported adapter does
    pytest.importorskip("peft", reason="the adapter is checked through peft's PeftModel")
    results = run_ranks(
        _megatron_lora_job, 2, str(_tiny_llama()), str(tmp_path / "adapter"), "merged", timeout=600
    )
    _check(results)
    assert results[0]["tensors"] == 2 + 1 + 2 * 9  # the merged model's names: no adapter tensor


def test_megatron_lora_tp2_adapter_reaches_vllm_through_its_lora_path(tmp_path):
    # the adapters alone, loaded by vLLM's LoRA path (enable_lora) over its unchanged base weights:
    # its greedy tokens are peft's with the same adapter, after a first update and a second one
    pytest.importorskip("peft", reason="the adapter is checked through peft's PeftModel")
    results = run_ranks(
        _megatron_lora_job, 2, str(_tiny_llama()), str(tmp_path / "adapter"), "adapter", timeout=600
    )
    _check(results)
    for r in results:
        assert r["after2"] == r["hf2"] and r["after2"] != r["after"]
        assert r["adapter"] == 2  # the second adapter replaced the first
    # peft's A and B of q, v, gate, up (megatron's fc1) and down, in 2 layers
    assert results[0]["tensors"] == 2 * 5 * 2


def test_zero3_weights_reach_vllm(tiny_path):
    results = run_ranks(_zero3_job, 2, str(tiny_path), timeout=600)
    _check(results)
