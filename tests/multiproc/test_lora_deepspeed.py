"""LoRA on the deepspeed backend, 2 gloo ranks at ZeRO-1 and ZeRO-3: a real GRPOTrainer trains the
adapters 3 steps with a KL term; the base weights stay bit-identical, no second model is built for
the reference, whose logprobs are the base model's, and the checkpoint's adapter folder loads in
peft and resumes the run."""

from __future__ import annotations

import gc

import pytest
from support.dist import run_ranks

pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra: pip install -e .[deepspeed]")
pytest.importorskip("peft", reason="LoRA trains with peft, an optional extra: pip install -e .[lora]")

STEPS = 3
TOKENS = [5, 17, 42, 99, 7, 250, 3, 11, 64, 128, 33, 9]


def _alternating(trajectories, rows):
    return [float(i % 2) for i in range(len(trajectories))]  # every group has a signal


def _params_in_memory() -> int:
    """Every torch Parameter alive in this process, counted whole (ZeRO-3 holds slices)."""
    import torch

    found = [o for o in gc.get_objects() if isinstance(o, torch.nn.Parameter)]
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in found)


def _job(rank, world_size, tiny_path, out, stage):
    import deepspeed
    import torch
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from interlens_mcore import distributed
    from interlens_mcore.grpo.batch import build_batch
    from interlens_mcore.grpo.loss.config import LossConfig
    from interlens_mcore.rollout.rollouter import RolloutConfig
    from interlens_mcore.tasks import GuessTasks
    from interlens_mcore.types import Trajectory
    from trainers import DeepSpeedBackend, GRPOTrainer, TrainerConfig, deepspeed_config

    tok = AutoTokenizer.from_pretrained(tiny_path)
    base_numel = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_path).parameters())
    gc.collect()

    def build():
        ds = deepspeed_config(zero_stage=stage, lr=2e-2, weight_decay=0.0, grad_clip=1.0, micro_batches=1)
        groups = distributed.build_groups(rollout="data_parallel" if stage == 3 else "model_parallel")
        lora = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
        backend = DeepSpeedBackend(
            model_path=tiny_path, ds_config=ds, groups=groups, tokenizer=tok, reference=True, lora=lora
        )
        trainer = GRPOTrainer(
            backend=backend,
            tasks=GuessTasks(),
            groups=groups,
            tokenizer=tok,
            config=TrainerConfig(steps=STEPS, batch_size=2, output_dir=out, eval_every=0),
            rollout_config=RolloutConfig(num_generations=2, max_new_tokens=4),
            loss_config=LossConfig(beta=0.1),
            rewards=[_alternating],
        )
        return backend, trainer

    def weights(backend):
        named = list(backend.ds.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named]):  # whole ones under ZeRO-3
            return {n: p.detach().clone() for n, p in named}

    backend, trainer = build()
    gc.collect()
    in_memory = _params_in_memory()
    before = weights(backend)
    records = trainer.train()
    after = weights(backend)
    adapters = [n for n in after if "lora_" in n]
    batch = build_batch(
        [Trajectory(token_ids=TOKENS, loss_mask=[0] * 4 + [1] * 8, rollout_logprobs=None)],
        [1.0],
        layout=backend.layout,
    )
    reference = backend.logprobs_of(batch, reference=True)  # collective under ZeRO-3
    backend.ds.module.eval()
    with torch.no_grad():
        policy = backend.logprobs_of(batch)
        base = backend._logprobs(AutoModelForCausalLM.from_pretrained(tiny_path).eval(), batch)
    res = {
        "records": records,
        "trainable": sorted(n for n, p in backend.ds.module.named_parameters() if p.requires_grad)
        == sorted(adapters),
        "base_same": all(before[n].equal(after[n]) for n in after if n not in adapters),
        "adapters_moved": sum(not before[n].equal(after[n]) for n in adapters),
        "adapters": len(adapters),
        "in_memory": in_memory,
        "base_numel": base_numel,
        "adapter_numel": sum(after[n].numel() for n in adapters),
        "second_model": backend.reference is not None,
        "has_reference": backend.has_reference,
        "reference_vs_base": float((reference - base).abs().max()),
        "policy_vs_base": float((policy - base).abs().max()),
    }
    folder = trainer.checkpoint_root / f"step-{STEPS:06d}"
    res["adapter_files"] = sorted(p.name for p in (folder / "adapter").iterdir())
    if rank == 0:  # the adapter folder as a peft user loads it
        loaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_path), folder / "adapter"
        )
        with torch.no_grad():
            res["peft_vs_policy"] = float((backend._logprobs(loaded.eval(), batch) - policy).abs().max())
    del backend, trainer
    gc.collect()
    again, resumed = build()
    res["resumed_step"] = resumed.resume()
    restored = weights(again)
    res["resumed_same"] = all(restored[n].equal(after[n]) for n in after)
    return res


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)])  # ZeRO-3: the slow stage
def test_lora_trains_the_adapters_alone_with_the_base_as_reference(tmp_path, tiny_path, stage):
    results = run_ranks(_job, 2, str(tiny_path), str(tmp_path / "out"), stage, timeout=300)
    for r in results:
        assert len(r["records"]) == STEPS and all(x["grad_norm"] > 0 for x in r["records"])
        assert r["trainable"] and r["adapters"] > 0
        assert r["base_same"]  # the frozen base weights, bit for bit
        assert r["adapters_moved"] >= r["adapters"] // 2  # lora_B starts at 0 and moves; lora_A too
        # one model in memory: the base and its adapters, no reference copy
        assert not r["second_model"] and r["has_reference"]
        assert r["in_memory"] == r["base_numel"] + r["adapter_numel"]
        assert r["reference_vs_base"] < 1e-5  # adapters off: the base model's logprobs
        assert r["policy_vs_base"] > 1e-3  # adapters on: the trained policy differs
        assert (
            "adapter_model.safetensors" in r["adapter_files"] and "adapter_config.json" in r["adapter_files"]
        )
        assert r["resumed_step"] == STEPS and r["resumed_same"]
    assert results[0]["peft_vs_policy"] < 1e-5
