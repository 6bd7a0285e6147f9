"""The learning-rate schedule (trainers/schedule.py) and --gradient-accumulation-steps' micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.config import TrainerConfig
from trainers.schedule import lr_at, warmup_steps


def _curve(**kw) -> list[float]:
    cfg = TrainerConfig(lr=1.0, **kw)
    return [lr_at(s, cfg) for s in range(cfg.steps)]


def test_constant_without_warmup_is_the_old_behaviour():
    assert _curve(steps=5) == [1.0] * 5


def test_warmup_rises_linearly_to_the_peak_and_never_starts_at_zero():
    assert _curve(steps=6, warmup_steps=4) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    # a ratio of the run's steps, rounded up
    assert warmup_steps(TrainerConfig(steps=10, warmup_ratio=0.25)) == 3
    assert _curve(steps=10, warmup_ratio=0.25)[:4] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])


def test_linear_and_cosine_decay_after_the_warmup():
    linear = _curve(steps=6, warmup_steps=2, lr_scheduler_type="linear")
    assert linear == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    cosine = _curve(steps=6, warmup_steps=2, lr_scheduler_type="cosine")
    expected = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert cosine == pytest.approx(expected)
    assert all(lr > 0 for lr in cosine)  # the last step still learns


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"warmup_ratio": 1.0}, r"warmup_ratio must be in \[0, 1\)"),
        ({"warmup_ratio": 0.1, "warmup_steps": 3}, "warmup_steps and --warmup-ratio both set"),
        ({"warmup_steps": -1}, "warmup_steps must be >= 0"),
        ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type must be constant, linear or cosine"),
        ({"gradient_accumulation_steps": -2}, "gradient_accumulation_steps must be >= 0"),
    ],
)
def test_bad_schedule_options_name_the_field(kw, says):
    with pytest.raises(ValueError, match=says):
        TrainerConfig(**kw)


def test_gradient_accumulation_sets_the_micro_batch_size():
    cfg = TrainerConfig(batch_size=8, gradient_accumulation_steps=4)
    assert cfg.micro_batch_size(8, 0) == 2 and cfg.micro_batch_size(16, 0) == 4  # x trained seats
    assert cfg.micro_batch_size(8, 2) == 2  # the same size given both ways is fine
    with pytest.raises(ValueError, match="micro-batches of 2 trajectories but --micro-batch-size is 3"):
        cfg.micro_batch_size(8, 3)
    # TRL's per_device_train_batch_size 4 x gradient_accumulation_steps 4: --batch-size 16 here
    with pytest.raises(ValueError, match=r"or --batch-size 16 for N micro-batches of 4\)$"):
        cfg.micro_batch_size(8, 4)
    with pytest.raises(ValueError, match="gradient_accumulation_steps 3 does not divide the 8 trajectories"):
        TrainerConfig(batch_size=8, gradient_accumulation_steps=3).micro_batch_size(8, 0)
    assert TrainerConfig().micro_batch_size(8, 3) == 3  # unset: --micro-batch-size as before


def test_n_accumulated_micro_batches_make_the_one_big_batch_update():
    """--gradient-accumulation-steps 4: 4 backward passes, one optimizer step, the big batch's update."""
    from test_update import CFG, FakeBackend, _rollout

    from interlens_mcore.rollout.rollouter import micro_batches
    from trainers.update import update

    weights = []
    for steps in (0, 4):
        rollout, _, _ = _rollout(4)
        rollout.keep = torch.ones(4, dtype=torch.bool)
        size = TrainerConfig(batch_size=4, gradient_accumulation_steps=steps).micro_batch_size(4, 0)
        batches = micro_batches(rollout, micro_batch_size=size, layout="padded", pad_to_multiple=1, pad_id=0)
        backend = FakeBackend()
        update(backend, batches, rollout, loss_config=CFG)
        assert len(batches) == (steps or 1) and backend.backwards == len(batches)
        assert backend.steps_applied == 1
        weights.append(backend.table.weight.detach().clone())
    torch.testing.assert_close(weights[0], weights[1])
