"""--recompute on the megatron backend's CPU path (torch's checkpoint per transformer layer): the
same loss and the same gradients as without it, for full fine-tuning and for LoRA with dropout
(whose masks must be drawn again alike when a layer is recomputed), at TP=2 on 2 gloo ranks."""

from __future__ import annotations

import pytest
from support.dist import run_ranks

TOKENS = [5, 17, 42, 99, 7, 250, 3, 11, 64, 128, 33, 9, 70, 71, 72, 300]


def _job(rank, world_size, tiny_path: str):
    import torch
    from megatron.core import parallel_state

    from interlens_mcore import distributed
    from interlens_mcore.grpo.batch import build_batch
    from interlens_mcore.megatron.lora import LoRAOptions
    from interlens_mcore.types import Trajectory
    from trainers.backends.megatron import MegatronBackend

    batch = build_batch(
        [Trajectory(token_ids=TOKENS, loss_mask=[0] * 4 + [1] * 12, rollout_logprobs=None)] * 2, [1.0, -0.5]
    )
    out = {}
    for name, lora in (("full", None), ("lora", LoRAOptions(rank=4, alpha=8.0, dropout=0.2))):
        grads = {}
        for recompute in (False, True):
            distributed.init_megatron(2)
            groups = distributed.build_groups(rollout="model_parallel")
            backend = MegatronBackend(
                model_path=tiny_path, groups=groups, lr=1e-2, lora=lora, recompute=recompute
            )
            if lora is not None:  # B away from zero, the same on both runs: A's gradient is not 0
                gen = torch.Generator().manual_seed(1)
                with torch.no_grad():
                    for n, p in sorted(backend.model.named_parameters()):
                        if n.endswith("lora_B.weight"):
                            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            calls = []  # a layer inside a transformer layer runs again when the layer is recomputed
            fc2 = backend.model.decoder.layers[0].mlp.linear_fc2
            fc2.register_forward_pre_hook(lambda module, args, calls=calls: calls.append(1))
            lps = []
            for _ in range(2):  # two forwards: the second draws other dropout masks
                lp = backend.logprobs_of(batch)
                lps.append(lp.detach())
                loss = -(lp * batch.advantages * batch.loss_mask).sum() / batch.loss_mask.sum()
                backend.backward(loss)
            out[f"{name}_calls_{recompute}"] = len(calls)
            out[f"{name}_forwards_differ_{recompute}"] = float((lps[0] - lps[1]).abs().max())
            grads[recompute] = {
                n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None
            }
            del backend
            parallel_state.destroy_model_parallel()
        off, on = grads[False], grads[True]
        out[name] = out.get(name, {}) | {
            "same_names": sorted(off) == sorted(on) and len(off) > 0,
            "max_diff": max(float((off[k] - on[k]).abs().max()) for k in off),
            "max_grad": max(float(g.abs().max()) for g in off.values()),
        }
    return out


def test_recompute_gives_the_same_gradients(tiny_path):
    for r in run_ranks(_job, 2, str(tiny_path), timeout=300):
        for name in ("full", "lora"):
            assert r[name]["same_names"], name
            assert r[name]["max_grad"] > 0, name
            assert r[name]["max_diff"] == pytest.approx(0.0, abs=1e-6), (name, r[name])
            # 2 forwards; with --recompute each layer ran again in each backward
            assert (r[f"{name}_calls_False"], r[f"{name}_calls_True"]) == (2, 4), r
        # no update between the two forwards: only LoRA's dropout (other masks each forward) differs
        for recompute in (False, True):
            assert r[f"full_forwards_differ_{recompute}"] == 0.0
            assert r[f"lora_forwards_differ_{recompute}"] > 1e-3, r
