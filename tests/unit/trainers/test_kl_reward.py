"""--kl-in-reward: the per-sample KL, the lowered rewards and their advantages, the controller, and
the coefficient's place in the checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch

from interlens_mcore.grpo.batch import build_batch
from interlens_mcore.rollout.rollouter import RolloutConfig, rollout_estimate
from interlens_mcore.types import Trajectory
from trainers import TrainerConfig, kl_reward, own_state


def sample(tokens, mask, reward=None, group=0):
    return Trajectory(token_ids=tokens, loss_mask=mask, rollout_logprobs=None, reward=reward, group=group)


class Logprobs:
    """A stand-in backend (the test is about the KL, not a model): the policy's logprob of a target
    t is -t / 10, the reference's -t / 5; it counts its forwards."""

    def __init__(self, layout="packed"):
        self.layout, self.pad_to_multiple, self.calls = layout, 1, []

    def logprobs_of(self, batch, *, reference=False):
        self.calls.append((batch.num_samples, reference))
        return -batch.targets.float() / (5.0 if reference else 10.0)

    def backward(self, loss):
        raise AssertionError("no gradient")

    def optimizer_step(self):
        raise AssertionError("no update")


def k3(policy, reference):
    d = reference - policy
    return math.exp(d) - d - 1


def hand_kl(t):
    """Sample t's k3 KL summed over its trained tokens, with the stand-in's logprobs."""
    return sum(k3(-x / 10, -x / 5) for x, m in zip(t.token_ids, t.loss_mask, strict=True) if m)


def test_the_kl_of_each_sample_is_its_trained_tokens_sum_in_both_layouts():
    samples = [
        sample([3, 4, 5, 6], [0, 1, 1, 0]),
        sample([7, 8, 9], [0, 0, 1]),
        sample([2, 2, 2, 1, 3], [0, 1, 0, 1, 1]),
    ]
    expected = [hand_kl(t) for t in samples]
    for layout in ("packed", "padded"):
        batch = build_batch(samples, [0.0] * 3, layout=layout, pad_to_multiple=4, pad_id=0)
        back = Logprobs(layout)
        sums, counts = kl_reward.per_sample_kl(
            batch,
            back.logprobs_of(batch),
            back.logprobs_of(batch, reference=True),
            estimator="k3",
            clamp=20.0,
        )
        assert sums.tolist() == pytest.approx(expected, rel=1e-6), layout
        assert counts.tolist() == [2.0, 1.0, 3.0], layout


def test_a_token_without_a_finite_logprob_counts_for_neither():
    batch = build_batch([sample([3, 4, 5], [0, 1, 1])], [0.0], layout="padded")
    back = Logprobs("padded")
    policy, reference = back.logprobs_of(batch), back.logprobs_of(batch, reference=True)
    reference[0, 1] = -math.inf  # the target 5 at position 1
    sums, counts = kl_reward.per_sample_kl(batch, policy, reference, estimator="k3", clamp=20.0)
    assert sums.tolist() == pytest.approx([k3(-0.4, -0.8)])
    assert counts.tolist() == [1.0]


def test_every_chunk_forwards_even_with_nothing_to_train():
    # micro-batches of 2: the second holds only an untrained sample, the forwards still happen
    # there (a sharded backend gathers its weights in each one), its KL is 0 with 0 tokens
    samples = [sample([3, 4, 5], [0, 1, 1]), sample([6, 7], [0, 1]), sample([1, 2, 3], [0, 0, 0])]
    back = Logprobs()
    kl = kl_reward.sample_kl(back, samples, micro_batch_size=2, pad_id=0, estimator="k3", clamp=20.0)
    assert back.calls == [(2, False), (2, True), (1, False), (1, True)]
    assert kl.total.tolist() == pytest.approx([hand_kl(samples[0]), hand_kl(samples[1]), 0.0])
    assert kl.tokens.tolist() == [2.0, 1.0, 0.0]
    assert kl_reward.mean_token_kl(kl) == pytest.approx((hand_kl(samples[0]) / 2 + hand_kl(samples[1]), 2.0))


def test_advantages_come_from_the_lowered_rewards_and_the_rewards_come_back():
    rewards = [1.0, 0.0, 1.0, 1.0]
    samples = [sample([1, 2, 3], [0, 1, 1], r, group=i // 2) for i, r in enumerate(rewards)]
    penalties = torch.tensor([0.5, 0.1, 0.0, 0.3], dtype=torch.float64)
    config = RolloutConfig(num_generations=2)
    with kl_reward.penalized(samples, penalties):
        est = rollout_estimate(samples, config)
    assert [t.reward for t in samples] == rewards
    lowered = [
        sample([1, 2, 3], [0, 1, 1], r - p, group=i // 2)
        for i, (r, p) in enumerate(zip(rewards, penalties.tolist()))
    ]
    plain = rollout_estimate(lowered, config)
    assert est.advantages.tolist() == pytest.approx(plain.advantages.tolist())
    # group 1 had equal rewards (no signal); its KLs differ, so now it has one
    assert est.advantages[2] > 0 > est.advantages[3]


def test_the_rewards_come_back_when_the_block_raises():
    samples = [sample([1, 2], [0, 1], 1.0), sample([1, 2], [0, 1], None)]
    with pytest.raises(RuntimeError), kl_reward.penalized(samples, torch.tensor([0.5, 0.5])):
        assert [t.reward for t in samples] == [0.5, None]  # an unscored sample stays unscored
        raise RuntimeError("inside")
    assert [t.reward for t in samples] == [1.0, None]


def test_the_adaptive_coefficient_moves_as_verl_s_controller():
    ctl = kl_reward.KLController(0.1, "adaptive", target=0.1, horizon=1000)
    ctl.update(0.15, 100)  # error 0.5, clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    ctl.update(0.09, 100)  # error -0.1
    assert ctl.value == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 0.1))
    before = ctl.value
    ctl.update(math.nan, 100)  # a step with nothing trained moves nothing
    assert ctl.value == before
    fixed = kl_reward.KLController(0.1)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1


def test_the_coefficient_is_saved_as_json_and_checked(tmp_path):
    own_state.TrainerState.capture(step=3, skipped_steps=0, kl_coef=0.0625).write(tmp_path, 0)
    assert own_state.read(tmp_path, 0).kl_coef == 0.0625
    plain = tmp_path / "plain"
    plain.mkdir()
    own_state.TrainerState.capture(step=3, skipped_steps=0).write(plain, 0)
    assert "kl_coef" not in json.loads((plain / "trainer-rank00000.json").read_text())
    assert own_state.read(plain, 0).kl_coef is None
    path = tmp_path / "trainer-rank00000.json"
    data = json.loads(path.read_text())
    for bad in (-1.0, "0.1", math.inf):
        path.write_text(json.dumps({**data, "kl_coef": bad}))
        with pytest.raises(ValueError, match="kl_coef must be a finite number > 0"):
            own_state.read(tmp_path, 0)


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"kl_ctrl": "adaptive"}, "kl_horizon shape TrainerConfig.kl_in_reward: give it too"),
        ({"kl_in_reward": True, "kl_target": 0.0}, "kl_target must be a finite number > 0, got 0.0"),
        ({"kl_in_reward": True, "kl_target": math.nan}, "kl_target must be a finite number > 0, got nan"),
        ({"kl_in_reward": True, "kl_horizon": 0}, "kl_horizon must be >= 1, got 0"),
        ({"kl_in_reward": True, "kl_ctrl": "pid"}, "kl_ctrl must be fixed or adaptive, got 'pid'"),
    ],
)
def test_bad_controller_settings_are_refused(fields, said):
    with pytest.raises(ValueError, match=said.replace("(", r"\(")):
        TrainerConfig(**fields)
