"""The training seam (megatron/training.py) and the spec choice, as far as a CPU can check them.

The GPU path itself (megatron's DDP and optimizer, TE) runs in launch/gpu_check.sh. Here: the
megatron configs built from our options, which path and which layer modules are chosen where,
the refusal of pipeline / context parallelism, and the CPU path's step on 2 gloo ranks.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.dist import run_ranks

from interlens_mcore import distributed


def test_ddp_config_reduces_in_fp32_with_our_overlap_options():
    from interlens_mcore.megatron.training import TrainingOptions, ddp_config

    cfg = ddp_config(TrainingOptions(lr=1e-5, overlap_grad_reduce=True, distributed_optimizer=True))
    assert cfg.grad_reduce_in_fp32 and cfg.overlap_grad_reduce and cfg.use_distributed_optimizer
    assert not cfg.overlap_param_gather and not cfg.check_for_nan_in_grad
    plain = ddp_config(TrainingOptions(lr=1e-5, distributed_optimizer=False))
    assert not plain.use_distributed_optimizer and not plain.overlap_grad_reduce


def test_optimizer_config_is_adamw_bf16_with_fp32_main_weights():
    from interlens_mcore.megatron.training import TrainingOptions, optimizer_config

    opts = TrainingOptions(lr=3e-6, weight_decay=0.01, grad_clip=0.5, adam_betas=(0.9, 0.95), adam_eps=1e-6)
    cfg = optimizer_config(opts)
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.decoupled_weight_decay) == ("adam", 3e-6, 0.01, True)
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, cfg.clip_grad) == (0.9, 0.95, 1e-6, 0.5)
    assert cfg.bf16 and not cfg.fp16 and cfg.params_dtype == torch.bfloat16
    assert cfg.main_params_dtype == torch.float32 and cfg.main_grads_dtype == torch.float32
    assert cfg.use_distributed_optimizer
    assert cfg.loss_scale == 1.0  # megatron's inf / NaN check and skip, without changing a number
    fp32 = optimizer_config(TrainingOptions(lr=1e-5, bf16=False))
    assert not fp32.bf16 and fp32.params_dtype == torch.float32


def test_model_overrides_per_path():
    from interlens_mcore.megatron.training import TrainingOptions, model_overrides

    opts = TrainingOptions(lr=1e-5, sequence_parallel=True)
    assert model_overrides(opts, path="torch", tp_size=2) == {}
    assert model_overrides(opts, path="megatron", tp_size=2) == {
        "bf16": True,
        "params_dtype": torch.bfloat16,
        "sequence_parallel": True,
    }
    assert model_overrides(opts, path="megatron", tp_size=1)["sequence_parallel"] is False  # no TP, no SP


def test_training_options_refuse_what_cannot_work():
    from interlens_mcore.megatron.training import TrainingOptions

    with pytest.raises(ValueError, match="grad_clip must be > 0, got 0"):
        TrainingOptions(lr=1e-5, grad_clip=0)
    with pytest.raises(ValueError, match="overlap_param_gather needs distributed_optimizer=True"):
        TrainingOptions(lr=1e-5, overlap_param_gather=True, distributed_optimizer=False)
    with pytest.raises(ValueError, match="not supported with a colocated engine"):
        TrainingOptions(lr=1e-5, overlap_param_gather=True)


def test_path_and_spec_chosen_for_where_the_model_runs():
    from interlens_mcore.megatron.spec import choose_spec
    from interlens_mcore.megatron.training import choose_path

    assert choose_path(cuda=True) == "megatron" and choose_path(cuda=False) == "torch"
    assert choose_path() == ("megatron" if torch.cuda.is_available() else "torch")
    assert choose_spec(cuda=True, have_te=True) == "transformer_engine"
    assert choose_spec(cuda=True, have_te=False) == "local"
    assert choose_spec(cuda=False, have_te=True) == "sdpa_cpu"


def test_layer_specs_hold_the_modules_they_name():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from interlens_mcore.megatron.spec import HAVE_TE, SDPACoreAttention, layer_spec

    def core(kind):
        return layer_spec(kind, rotary_base=5e5).submodules.self_attention.submodules.core_attention

    # local: megatron's layers and RoPE; SDPA attends because megatron's local attention refuses THD
    assert core("local").module is SDPACoreAttention and core("local").params == {"rotary_base": None}
    assert core("sdpa_cpu").params == {"rotary_base": 5e5}  # rotates inside, megatron's RoPE is off
    assert core("local").module is not DotProductAttention
    if HAVE_TE:
        assert "TEDotProductAttention" in core("transformer_engine").module.__name__
    else:
        with pytest.raises(ValueError, match="'transformer_engine' needs transformer_engine installed"):
            layer_spec("transformer_engine", rotary_base=1e4)
    with pytest.raises(ValueError, match="layer spec must be one of"):
        layer_spec("flash", rotary_base=1e4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=2, pp=2, world=2), "--tp 2 x --pp 2 does not divide the world size 2"),
        (dict(tp=1, cp=2, world=2), "--cp 2: context parallelism is not supported yet"),
        (dict(tp=3, world=4), "--tp 3 does not divide the world size 4"),
    ],
)
def test_layouts_that_do_not_fit_and_context_parallelism_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        distributed.check_layout(**kwargs)
    distributed.check_layout(tp=2, world=4)  # TP x DP is fine
    distributed.check_layout(tp=2, pp=2, world=8)  # and TP x PP x DP


def _cpu_step_job(rank, world_size, path: str):
    """The CPU path at TP=1 (DP=2) and TP=2: same loss, same norm; a NaN step is skipped."""
    from megatron.core import parallel_state, tensor_parallel

    from interlens_mcore.megatron import build_model, forward_logits, load_hf_weights, load_layout
    from interlens_mcore.megatron.checkpoint import full_tensors
    from interlens_mcore.megatron.training import TrainingOptions, build_training

    seq = torch.tensor([[5, 9, 33, 2, 100, 7, 1, 2, 3, 44]])
    out = {}
    for tp in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        layout = load_layout(path)
        model = build_model(layout, init_weights=False)
        load_hf_weights(model, layout, path)
        groups = distributed.build_groups()
        training = build_training(model, TrainingOptions(lr=1e-2, grad_clip=0.05), groups)
        logits = forward_logits(training.train_model, layout, seq)  # [1, T, V / tp]
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits[0, :-1, None], seq[0, 1:, None]).mean()
        # every DP rank has the same loss: "/ dp_size" makes the DP average of the sum this loss
        training.backward(loss / groups.dp_size)
        before = full_tensors(model, layout)
        norm = training.step()
        after = full_tensors(model, layout)
        # a NaN scaling makes every gradient NaN (as the trainer does with a non-finite loss)
        training.backward(forward_logits(training.train_model, layout, seq).sum() * float("nan"))
        skipped = training.step()
        out[tp] = {
            "path": training.path,
            "wrapper": type(training.train_model).__name__,
            "norm": norm,
            "moved": max(float((after[k] - before[k]).abs().max()) for k in before),
            "skipped_norm": skipped,
            "unchanged_after_skip": all(
                torch.equal(after[k], v) for k, v in full_tensors(model, layout).items()
            ),
            "grads_cleared": all(p.grad is None for p in model.parameters()),
        }
        parallel_state.destroy_model_parallel()
    return out


def test_cpu_path_steps_the_same_at_tp1_and_tp2_and_skips_a_nan_step(tiny_path):
    results = run_ranks(_cpu_step_job, 2, str(tiny_path), timeout=180)
    for r in results:
        assert r[1]["path"] == r[2]["path"] == "torch"
        assert r[1]["wrapper"] == "DistributedDataParallel"  # DP=2 at TP=1
        assert r[2]["wrapper"] == "GPTModel"  # DP=1 at TP=2
        assert r[1]["norm"] > 0.05  # so clipping was active
        assert r[1]["norm"] == pytest.approx(r[2]["norm"], rel=1e-5)  # TP slices counted once each
        assert r[1]["moved"] > 0 and r[2]["moved"] > 0
        for tp in (1, 2):
            assert math.isnan(r[tp]["skipped_norm"])
            assert r[tp]["unchanged_after_skip"] and r[tp]["grads_cleared"]
