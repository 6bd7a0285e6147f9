"""A non-finite loss or gradient skips the update on every rank together, and is counted.

Each run trains 4 steps on 2 real gloo ranks with two faults planted on one rank each:

    step 0  normal                        weights move
    step 1  rank 1's loss + NaN           weights stay bit-identical; step_skipped 1
    step 2  inf in one gradient on rank 0 weights stay bit-identical; step_skipped 1
    step 3  normal                        weights move; skipped_steps stays 2

`loss + NaN` has a finite gradient, so step 1 is skipped only if the trainer turns a
non-finite loss into non-finite gradients; step 2 is skipped on both ranks only if the
backend's norm sees one rank's inf (under TP=2: one rank's copy of a replicated norm weight).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from support.dist import run_ranks

NAN_STEP, INF_STEP, STEPS = 1, 2, 4


def _alternating(trajectories, rows):
    # 0, 1 within every group of 2: advantages are never all zero, so a normal step moves
    return [float(i % 2) for i in range(len(trajectories))]


def _faulty_trainer(backend, groups, tiny_path, out, grad_param: str, module, weights):
    """A GRPOTrainer with the two faults above; `grad_param` names the parameter given an inf."""
    from transformers import AutoTokenizer

    from interlens_mcore.grpo.loss.config import LossConfig
    from interlens_mcore.grpo.loss.objective import batch_loss
    from interlens_mcore.rollout.rollouter import RolloutConfig
    from interlens_mcore.tasks import GuessTasks
    from trainers import GRPOTrainer, TrainerConfig

    class Watched(GRPOTrainer):
        """Records, per step, whether the weights moved and a digest of them."""

        moved: list[bool] = []
        digests: list[str] = []

        def train_step(self):
            before = weights()
            out = super().train_step()
            after = weights()
            self.moved.append(any(not a.equal(b) for a, b in zip(before, after, strict=True)))
            self.digests.append(hashlib.sha256(b"".join(w.numpy().tobytes() for w in after)).hexdigest())
            return out

    def loss_fn(logprobs, batch, config, **kwargs):
        loss, metrics = batch_loss(logprobs, batch, config, **kwargs)
        if trainer.step == NAN_STEP and groups.rank == 1:
            loss = loss + float("nan")  # gradient still finite: the trainer must catch it
        return loss, metrics

    def inject_inf(grad):
        if trainer.step != INF_STEP or groups.rank != 0:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    dict(module().named_parameters())[grad_param].register_hook(inject_inf)
    trainer = Watched(
        backend=backend,
        tasks=GuessTasks(),
        groups=groups,
        tokenizer=AutoTokenizer.from_pretrained(tiny_path),
        config=TrainerConfig(steps=STEPS, batch_size=2, output_dir=out, eval_every=0),
        rollout_config=RolloutConfig(num_generations=2, max_new_tokens=4),
        loss_config=LossConfig(beta=0.0),
        rewards=[_alternating],
        loss_fn=loss_fn,
    )
    trainer.moved, trainer.digests = [], []
    return trainer


def _run(trainer) -> dict:
    records = trainer.train()
    trainer.skipped_steps = 0
    trainer.resume()  # the counter comes back from the trainer state of the last checkpoint
    text = (Path(trainer.output_dir) / "metrics.jsonl").read_text() if trainer.groups.rank == 0 else ""
    return {
        "records": records,
        "moved": trainer.moved,
        "digests": trainer.digests,
        "restored": trainer.skipped_steps,
        "checkpoints": sorted(p.name for p in trainer.checkpoint_root.iterdir()),
        "jsonl": text,
    }


def _megatron(rank, world_size, tiny_path, out, tp):
    from interlens_mcore import distributed
    from trainers import MegatronBackend

    distributed.init_megatron(tp)
    groups = distributed.build_groups(rollout="model_parallel")
    backend = MegatronBackend(model_path=tiny_path, groups=groups, lr=2e-3)

    def weights():
        return [p.detach().clone() for p in backend.model.parameters()]

    # a norm weight: replicated under TP, so at TP=2 only rank 0's copy holds the inf
    grad_param = "decoder.final_layernorm.weight"
    return _run(_faulty_trainer(backend, groups, tiny_path, out, grad_param, lambda: backend.model, weights))


def _norm_of_fixed_batch(rank, world_size, tiny_path, out, tp):
    """MegatronBackend.grad_norm after one backward of a fixed batch, and torch's norm."""
    import torch

    from interlens_mcore import distributed
    from interlens_mcore.grpo.batch import build_batch
    from interlens_mcore.types import Trajectory
    from trainers import MegatronBackend

    distributed.init_megatron(tp)
    backend = MegatronBackend(
        model_path=tiny_path, groups=distributed.build_groups(rollout="model_parallel"), lr=1e-3
    )
    tokens = [5, 17, 42, 99, 7, 250, 3, 11, 64, 128]
    t = Trajectory(token_ids=tokens, loss_mask=[0] * 4 + [1] * 6, rollout_logprobs=None)
    batch = build_batch([t], [1.0])
    backend.backward(-backend.logprobs_of(batch).sum())
    local = torch.nn.utils.get_total_norm([p.grad for p in backend.model.parameters() if p.grad is not None])
    return float(backend.grad_norm()), float(local)


def test_megatron_tp2_grad_norm_is_the_whole_models(tmp_path, tiny_path):
    [(tp1, torch_norm)] = run_ranks(_norm_of_fixed_batch, 1, str(tiny_path), str(tmp_path / "a"), 1)
    tp2 = run_ranks(_norm_of_fixed_batch, 2, str(tiny_path), str(tmp_path / "b"), 2)
    # one rank: torch's float32 norm of every gradient (ours sums in float64)
    assert tp1 == pytest.approx(torch_norm, rel=1e-5)
    # two shards plus replicated norm weights add up to the one-rank model's norm; each rank's
    # own squares alone would fall short (the embedding and linear weights are halves)
    for norm, local in tp2:
        assert norm == pytest.approx(tp1, rel=1e-4)
        assert local < 0.99 * tp1


def _deepspeed(rank, world_size, tiny_path, out, stage):
    import deepspeed
    from transformers import AutoTokenizer

    from interlens_mcore import distributed
    from trainers import DeepSpeedBackend, deepspeed_config

    ds = deepspeed_config(zero_stage=stage, lr=2e-3, weight_decay=0.0, grad_clip=1.0, micro_batches=1)
    groups = distributed.build_groups(rollout="data_parallel" if stage == 3 else "model_parallel")
    backend = DeepSpeedBackend(
        model_path=tiny_path, ds_config=ds, groups=groups, tokenizer=AutoTokenizer.from_pretrained(tiny_path)
    )

    def weights():
        params = list(backend.ds.module.parameters())
        # ZeRO-3 holds a slice of each parameter per rank: gather whole ones (collective)
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]

    trainer = _faulty_trainer(
        backend, groups, tiny_path, out, "model.norm.weight", lambda: backend.ds.module, weights
    )
    return _run(trainer)


def _check(results, *, replicas: bool) -> None:
    for r in results:
        assert r["moved"] == [True, False, False, True]
        assert [x["step_skipped"] for x in r["records"]] == [0, 1, 1, 0]
        assert [x["skipped_steps"] for x in r["records"]] == [0, 1, 2, 2]
        norms = [x["grad_norm"] for x in r["records"]]
        assert norms[NAN_STEP] is None and norms[INF_STEP] is None  # non-finite: written null
        assert norms[0] > 0 and norms[3] > 0
        assert r["restored"] == 2
        assert r["checkpoints"] == [f"step-{STEPS:06d}"]
    if replicas:  # DP replicas (or ZeRO's gathered weights) equal after every step
        assert results[0]["digests"] == results[1]["digests"]
    lines = [json.loads(line) for line in results[0]["jsonl"].splitlines()]
    assert [x["step_skipped"] for x in lines] == [0, 1, 1, 0]
    # JSON has no NaN: Python would write the bare token NaN (or Infinity), which json.loads accepts
    assert "NaN" not in results[0]["jsonl"] and "Infinity" not in results[0]["jsonl"]


def test_megatron_dp2_skips_nonfinite_steps(tmp_path, tiny_path):
    results = run_ranks(_megatron, 2, str(tiny_path), str(tmp_path / "out"), 1, timeout=120)
    _check(results, replicas=True)


def test_megatron_tp2_skips_nonfinite_steps(tmp_path, tiny_path):
    results = run_ranks(_megatron, 2, str(tiny_path), str(tmp_path / "out"), 2, timeout=120)
    _check(results, replicas=False)


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_skips_nonfinite_steps(tmp_path, tiny_path, stage):
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra: pip install -e .[deepspeed]")
    results = run_ranks(_deepspeed, 2, str(tiny_path), str(tmp_path / "out"), stage, timeout=180)
    _check(results, replicas=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"zero_optimization": {"stage": 0}}, "zero_optimization.stage must be 1, 2 or 3, got 0"),
        (
            {"bf16": {"enabled": True, "check_grad_overflow": False}},
            "bf16.check_grad_overflow must stay true",
        ),
    ],
)
def test_deepspeed_refuses_configs_that_would_apply_nonfinite_steps(tmp_path, change, message):
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra: pip install -e .[deepspeed]")
    from interlens_mcore import distributed
    from trainers import DeepSpeedBackend, deepspeed_config

    ds = deepspeed_config(zero_stage=1, lr=1e-3, weight_decay=0.0, grad_clip=1.0, micro_batches=1)
    with pytest.raises(ValueError, match=message):
        DeepSpeedBackend(
            model_path=tmp_path,  # never read: the config is checked first
            ds_config={**ds, **change},
            groups=distributed.ParallelGroups(rank=0, world_size=1),
            tokenizer=None,
        )
