"""LoRA on the megatron backend, 2 gloo ranks: a MegatronBackend with adapters on part of the fused
q/k/v layer (q_proj, v_proj) and on every MLP layer, dropout on, beta > 0.

One job tells the whole story, the test asserts on what it returns:
  TP=2: 2 steps on a fixed batch; the base stays bit-identical, no second model exists, the
  reference (adapters off) is the base model's logprobs; the checkpoint's `adapter/` loads in
  peft and the HF export (merged) computes the policy's logprobs; a fresh backend resumes it.
  TP=1 (DP=2, the same batch on both replicas): the same 2 steps give the same adapters, and
  the TP=2 checkpoint loads at TP=1.
  PP=2 (megatron's schedule, which runs each forward again in its backward): the same 2 steps,
  dropout masks included, give the same norms and adapters; its peft `adapter/` holds both
  stages' adapters, and the TP=2 checkpoint loads at PP=2.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from support.dist import run_ranks

pytest.importorskip("peft", reason="LoRA adapters are written in peft's layout, an optional extra: .[lora]")

TOKENS = [5, 17, 42, 99, 7, 250, 3, 11, 64, 128, 33, 9, 70, 71, 72, 300]
TARGETS = ("q_proj", "v_proj", "linear_proj", "linear_fc1", "down_proj")


def _job(rank, world_size, tiny_path: str, root: str):
    import torch
    from megatron.core import parallel_state
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from interlens_mcore import distributed
    from interlens_mcore.grpo.batch import build_batch
    from interlens_mcore.grpo.logprobs import token_logprobs
    from interlens_mcore.megatron import checkpoint as ckpt
    from interlens_mcore.megatron.lora import LoRAOptions
    from interlens_mcore.types import Trajectory
    from trainers.backends.megatron import MegatronBackend

    batch = build_batch(
        [
            Trajectory(token_ids=TOKENS, loss_mask=[0] * 4 + [1] * 12, rollout_logprobs=None),
            Trajectory(token_ids=TOKENS[::-1], loss_mask=[0] * 6 + [1] * 10, rollout_logprobs=None),
        ],
        [1.0, -0.5],
    )
    options = LoRAOptions(rank=4, alpha=8.0, dropout=0.1, target_modules=TARGETS)

    def build(tp: int, pp: int = 1) -> MegatronBackend:
        distributed.init_megatron(tp, pp=pp)
        groups = distributed.build_groups(rollout="model_parallel")
        return MegatronBackend(model_path=tiny_path, groups=groups, lr=1e-2, reference=True, lora=options)

    def steps(backend: MegatronBackend, n: int) -> list[float]:
        dp = backend.groups.dp_size  # each replica holds the whole batch: the global count is dp x
        adv = batch.advantages * batch.loss_mask  # [1, T]
        norms = []
        for _ in range(n):
            lp = backend.logprobs_of(batch)  # [1, T], dropout on: training mode
            loss = -(lp * adv).sum() / (batch.loss_mask.sum() * dp)
            backend.backward(loss)
            norms.append(backend.optimizer_step())
        return norms

    def policy_logprobs(backend: MegatronBackend) -> torch.Tensor:
        backend.model.eval()
        with torch.no_grad():
            return backend._logprobs(backend.model, batch)

    hf = AutoModelForCausalLM.from_pretrained(tiny_path).eval()

    def hf_logprobs(model) -> torch.Tensor:
        cu = batch.cu_seqlens.tolist()
        parts = []
        with torch.no_grad():
            for s, e in zip(cu[:-1], cu[1:]):  # one sample at a time: no packed attention in HF's sdpa
                logits = model(input_ids=batch.input_ids[:, s:e]).logits[0]
                parts.append(token_logprobs(logits, batch.targets[0, s:e]))
        return torch.cat(parts)[None]

    def params_alive() -> int:
        gc.collect()
        return sum(o.numel() for o in gc.get_objects() if isinstance(o, torch.nn.Parameter))

    out: dict = {}
    base_alive = params_alive()  # the HF model above
    backend = build(2)
    alive = params_alive() - base_alive
    model_numel = sum(p.numel() for p in backend.model.parameters())
    out["one_model"] = alive == model_numel and backend.reference is None and backend.has_reference
    out["trainable_are_adapters"] = all(
        (".lora_" in n) == p.requires_grad for n, p in backend.model.named_parameters()
    )
    before = ckpt.full_tensors(backend.model, backend.layout_info)
    out["norms_tp2"] = steps(backend, 2)
    after = ckpt.full_tensors(backend.model, backend.layout_info)
    out["base_same"] = all(before[k].equal(after[k]) for k in after if ".lora_" not in k)
    adapters = sorted(k for k in after if ".lora_" in k)
    out["adapters"] = len(adapters)
    out["adapters_moved"] = sum(not before[k].equal(after[k]) for k in adapters)
    # k_proj is not named: its rows of the fused q/k/v B stay zero (the layer's kv rows, 16 of 64)
    out["reference_vs_base"] = float(
        (backend.logprobs_of(batch, reference=True) - hf_logprobs(hf)).abs().max()
    )
    policy = policy_logprobs(backend)
    out["policy_vs_base"] = float((policy - hf_logprobs(hf)).abs().max())
    folder = Path(root) / "tp2"
    backend.save(folder)
    exported = backend.export_hf(Path(root) / "merged")
    if rank == 0:
        out["adapter_files"] = sorted(p.name for p in (Path(folder) / "adapter").iterdir())
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_path), folder / "adapter"
        ).eval()
        out["peft_targets"] = sorted(peft_model.peft_config["default"].target_modules)
        out["peft_vs_policy"] = float((hf_logprobs(peft_model) - policy).abs().max())
        merged = AutoModelForCausalLM.from_pretrained(exported).eval()
        out["merged_vs_policy"] = float((hf_logprobs(merged) - policy).abs().max())
        out["saved"] = sorted(ckpt.saved_tensors(folder))
    again = build(2)
    again.load(folder)
    restored = ckpt.full_tensors(again.model, again.layout_info)
    out["resumed_same"] = all(restored[k].equal(after[k]) for k in after)
    tp2_adapters = {k: after[k] for k in adapters}
    del backend, again
    parallel_state.destroy_model_parallel()

    backend = build(1)  # DP=2: both replicas see the whole batch
    out["norms_tp1"] = steps(backend, 2)
    at_tp1 = ckpt.full_tensors(backend.model, backend.layout_info)
    out["tp1_vs_tp2"] = max(float((at_tp1[k] - tp2_adapters[k]).abs().max()) for k in adapters)
    backend.load(folder)  # the TP=2 checkpoint at TP=1
    loaded = ckpt.full_tensors(backend.model, backend.layout_info)
    out["tp2_checkpoint_at_tp1"] = all(loaded[k].equal(tp2_adapters[k]) for k in adapters)
    del backend
    parallel_state.destroy_model_parallel()

    backend = build(1, pp=2)  # a stage a rank, the batch through megatron's schedule
    out["norms_pp2"] = steps(backend, 2)
    at_pp2 = ckpt.full_tensors(backend.model, backend.layout_info)  # this stage's
    mine = [k for k in at_pp2 if ".lora_" in k]
    out["pp2_adapters"] = len(mine)
    out["pp2_vs_tp2"] = max(float((at_pp2[k] - tp2_adapters[k]).abs().max()) for k in mine)
    backend._save_adapter(Path(root) / "pp2_adapter")
    if rank == 0:
        from safetensors.torch import load_file

        pp2_file = load_file(Path(root) / "pp2_adapter" / "adapter_model.safetensors")
        tp2_file = load_file(folder / "adapter" / "adapter_model.safetensors")
        out["pp2_file_keys_same"] = sorted(pp2_file) == sorted(tp2_file)
        out["pp2_file_vs_tp2"] = max(float((pp2_file[k] - tp2_file[k]).abs().max()) for k in tp2_file)
    backend.load(folder)  # the TP=2 checkpoint at PP=2
    loaded = ckpt.full_tensors(backend.model, backend.layout_info)
    out["tp2_checkpoint_at_pp2"] = all(loaded[k].equal(tp2_adapters[k]) for k in mine)
    return out


def test_megatron_lora_is_exact_under_tp_and_keeps_one_model(tmp_path, tiny_path):
    results = run_ranks(_job, 2, str(tiny_path), str(tmp_path), timeout=300)
    for r in results:
        assert r["one_model"] and r["trainable_are_adapters"]
        assert all(n > 0 for n in r["norms_tp2"])
        assert r["base_same"]  # the frozen base, bit for bit
        # 2 layers x (qkv, proj, fc1, fc2) x (A, B); B starts at zero, and both move
        assert r["adapters"] == 16 and r["adapters_moved"] == 16
        assert r["reference_vs_base"] < 1e-4  # adapters off: the base model's logprobs
        assert r["policy_vs_base"] > 1e-3
        assert r["resumed_same"]
        # TP=2 and TP=1 (DP=2) agree: the same dropout masks, exact adapter gradients
        assert r["norms_tp1"] == pytest.approx(r["norms_tp2"], rel=1e-4)
        # Adam moves each entry by about lr (1e-2) whatever its gradient's size, so the float
        # rounding of tiny gradients (summed in another order over TP) shows at ~1e-5 here
        assert r["tp1_vs_tp2"] < 1e-4
        assert r["tp2_checkpoint_at_tp1"]
        # PP=2: each stage one of the 2 layers; the same steps, dropout masks included
        assert r["pp2_adapters"] == 8
        assert r["norms_pp2"] == pytest.approx(r["norms_tp2"], rel=1e-4)
        assert r["pp2_vs_tp2"] < 1e-4
        assert r["tp2_checkpoint_at_pp2"]
    first = results[0]
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(first["adapter_files"])
    assert first["peft_targets"] == sorted(
        ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert first["peft_vs_policy"] < 1e-4 and first["merged_vs_policy"] < 1e-4
    assert first["pp2_file_keys_same"] and first["pp2_file_vs_tp2"] < 1e-4  # both stages' adapters
    # adapters and their optimizer state alone: no base weight in the checkpoint
    assert first["saved"] and all(
        ".lora_" in k or k.startswith("optimizer.param_groups") for k in first["saved"]
    )
