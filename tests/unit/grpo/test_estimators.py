"""Advantage estimators (grpo/estimators.py): hand-derived values per estimator, the batch step's
statistics against verl's token-level whitening and TRL's batch std written out on the same
inputs, the default unchanged, and the config's refusals."""

from __future__ import annotations

import math

import pytest
import torch

from interlens_mcore.grpo.advantages import group_advantages
from interlens_mcore.grpo.estimators import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    Estimate,
    EstimatorSettings,
    register_advantage_estimator,
)
from interlens_mcore.rollout.rollouter import (
    Rollout,
    RolloutConfig,
    rollout_advantages,
    rollout_estimate,
    whole_batch_advantages,
)
from interlens_mcore.types import Status, Trajectory


def _sample(group: int, reward: float, tokens: int) -> Trajectory:
    ids = list(range(1, tokens + 2))  # one prompt token, then `tokens` trained ones
    t = Trajectory(token_ids=ids, loss_mask=[0] + [1] * tokens, rollout_logprobs=None, group=group)
    t.reward, t.status = reward, Status.STOPPED
    return t


def _rollout(samples: list[Trajectory], config: RolloutConfig, **kwargs) -> Rollout:
    """One rank's whole pipeline: the local estimate, then the batch step with no other rank."""
    est = rollout_estimate(samples, config, **kwargs)
    rollout = Rollout(trajectories=samples, rows=[None] * len(samples))
    rollout.advantages, rollout.keep, rollout.batch_step = est.advantages, est.keep, est.batch
    whole_batch_advantages(rollout, lambda x: x)
    return rollout


def _estimated(samples: list[Trajectory], config: RolloutConfig, **kwargs) -> torch.Tensor:
    adv = _rollout(samples, config, **kwargs).advantages
    assert adv is not None
    return adv


# group 0: rewards 1, 0 with 3 and 1 trained tokens; group 1: rewards 2, 2 (no spread), 2 tokens each
SAMPLES = [(0, 1.0, 3), (0, 0.0, 1), (1, 2.0, 2), (1, 2.0, 2)]


def _batch() -> list[Trajectory]:
    return [_sample(*s) for s in SAMPLES]


def test_the_default_is_group_advantages_bit_for_bit():
    rewards, groups = [0.3, 0.9, 0.1, 0.7, 0.7, 0.2], [0, 0, 0, 1, 1, 1]
    samples = [_sample(g, r, 2) for g, r in zip(groups, rewards)]
    est = rollout_estimate(samples, RolloutConfig())
    expected, keep = group_advantages(rewards, groups)
    assert est.batch is None and torch.equal(est.advantages, expected) and torch.equal(est.keep, keep)


def test_rloo_is_the_mean_of_the_others_unscaled():
    # group [1, 0, 0, 0]: 1 - 0 = 1 and 0 - 1/3 = -1/3 (verl and ms-swift do not divide by a std)
    samples = [_sample(0, r, 1) for r in (1.0, 0.0, 0.0, 0.0)]
    adv, _ = rollout_advantages(samples, RolloutConfig(advantage_estimator="rloo"))
    assert adv.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-7)
    # --leave-one-out keeps the group std (the grpo estimator with RLOO's baseline)
    scaled, _ = rollout_advantages(samples, RolloutConfig(leave_one_out=True))
    assert scaled[0].item() == pytest.approx(1.0 / (0.5 + 1e-6), rel=1e-6)  # group std 0.5


def test_reinforce_plus_plus_baseline_whitens_over_tokens():
    # centred in the group: [0.5, -0.5, 0, 0]; token weights [3, 1, 2, 2], 8 in all
    # mean = (3 * 0.5 - 0.5) / 8 = 0.125; deviations [0.375, -0.625, -0.125, -0.125]
    # sum w d^2 = 3 * 0.140625 + 0.390625 + 4 * 0.015625 = 0.875; var = 0.875 / 7 = 0.125
    config = RolloutConfig(advantage_estimator="reinforce_plus_plus_baseline")
    adv = _estimated(_batch(), config)
    root = math.sqrt(0.125 + 1e-8)
    assert adv.tolist() == pytest.approx([0.375 / root, -0.625 / root, -0.125 / root, -0.125 / root])


def test_reinforce_plus_plus_has_no_group_baseline():
    # returns = rewards [1, 0, 2, 2]; token mean = (3 + 0 + 4 + 4) / 8 = 1.375
    # deviations [-0.375, -1.375, 0.625, 0.625]; sum w d^2 = 0.421875 + 1.890625 + 1.5625 = 3.875
    config = RolloutConfig(advantage_estimator="reinforce_plus_plus")
    adv = _estimated(_batch(), config)
    root = math.sqrt(3.875 / 7 + 1e-8)
    assert adv.tolist() == pytest.approx([-0.375 / root, -1.375 / root, 0.625 / root, 0.625 / root])
    assert adv[2].item() != 0.0  # a group with no spread still moves: its reward is above the mean


def _verl_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl 0.9.1's masked_whiten as its docs define it, on a [B, T] token matrix: mean and
    Bessel-corrected variance over the mask's tokens, (x - mean) * rsqrt(var + 1e-8)."""
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8) * mask


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_equal_to_verls_whitening_on_the_token_matrix(name):
    gen = torch.Generator().manual_seed(3)
    groups = [g for g in range(4) for _ in range(3)]
    rewards = torch.rand(12, generator=gen, dtype=torch.float64).tolist()
    lengths = torch.randint(1, 7, (12,), generator=gen).tolist()
    samples = [_sample(g, r, n) for g, r, n in zip(groups, rewards, lengths)]
    ours = _estimated(samples, RolloutConfig(advantage_estimator=name))
    # verl: the sample's score on each of its response tokens (minus its group mean for -baseline)
    scores = torch.tensor(rewards, dtype=torch.float64)
    if name == "reinforce_plus_plus_baseline":
        means = scores.view(4, 3).mean(dim=1).repeat_interleave(3)
        scores = scores - means
    mask = (torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]).double()  # [12, 6]
    verl = _verl_whiten(scores[:, None] * mask, mask)  # [12, 6]
    for i, n in enumerate(lengths):  # every token of a sample carries one value
        assert verl[i, :n].tolist() == pytest.approx([ours[i].item()] * n, rel=1e-6, abs=1e-6)


def test_batch_scale_divides_the_group_centred_advantage_by_the_batch_reward_std():
    # TRL scale_rewards="batch": (r - group mean) / (std of every reward in the batch + eps)
    trl_utils = pytest.importorskip("trl.trainer.utils")
    samples = _batch()
    adv = _estimated(samples, RolloutConfig(scale_rewards="batch"))
    rewards = torch.tensor([r for _, r, _ in SAMPLES], dtype=torch.float64)
    std = float(trl_utils.nanstd(rewards))  # TRL's own std, Bessel-corrected
    # mean 1.25, deviations [-0.25, -1.25, 0.75, 0.75]: sum of squares 2.75, over 3
    assert std == pytest.approx(math.sqrt(2.75 / 3))
    assert adv.tolist() == pytest.approx([0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.0, 0.0])


def test_normalize_then_sum_follows_trls_steps():
    # two reward functions; `b` gives None for sample 1 (left out of its group's statistics)
    trl_utils = pytest.importorskip("trl.trainer.utils")
    samples = [_sample(g, 0.0, 1) for g in (0, 0, 0, 1, 1, 1)]
    a = [1.0, 0.0, 2.0, 3.0, 3.0, 0.0]
    b = [0.5, None, 1.5, 1.0, 0.0, 2.0]
    weights = [1.0, 0.5]
    for t, x, y in zip(samples, a, b):
        t.reward = x + 0.5 * (y or 0.0)
    config = RolloutConfig(multi_objective_aggregation="normalize_then_sum")
    adv = _estimated(samples, config, components={"a": a, "b": b}, weights=weights)
    # TRL 1.16 written out: per function (r - nanmean) / (nanstd + eps) in each group, the
    # weighted nansum, then (sum - mean) / (std + eps) over the batch (TRL's eps is 1e-4, ours 1e-6)
    table = torch.tensor([a, [math.nan if v is None else v for v in b]], dtype=torch.float64).T
    grouped = table.view(2, 3, 2)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = trl_utils.nanstd(grouped, dim=1, keepdim=True)
    normed = ((grouped - mean) / (std + 1e-6)).view(6, 2)
    total = (normed * torch.tensor(weights, dtype=torch.float64)).nansum(dim=1)
    expected = (total - total.mean()) / (trl_utils.nanstd(total) + 1e-6)
    assert adv.tolist() == pytest.approx(expected.tolist(), rel=1e-5)


def test_samples_out_of_the_loss_stay_out_of_the_batch_statistics():
    samples = _batch() + [_sample(2, 100.0, 5), _sample(2, -100.0, 5)]
    samples[4].status = Status.FAILED  # out of every baseline; its partner alone has advantage 0
    config = RolloutConfig(advantage_estimator="reinforce_plus_plus_baseline")
    adv = _estimated(samples, config)
    alone = _estimated(_batch() + [_sample(2, -100.0, 5)], config)
    assert adv[4].item() == 0.0
    # the lone sample of group 2 (centred to 0, 5 tokens) counts; the failed one does not
    assert adv.tolist()[:4] == pytest.approx(alone.tolist()[:4]) and adv[5] == alone[4]


def test_a_batch_step_runs_once():
    samples = _batch()
    rollout = _rollout(samples, RolloutConfig(advantage_estimator="reinforce_plus_plus"))
    before = _estimated(_batch(), RolloutConfig(advantage_estimator="reinforce_plus_plus"))
    whole_batch_advantages(rollout, lambda x: x * 0 + 1)  # would change everything if it ran again
    assert rollout.advantages is not None and torch.equal(rollout.advantages, before)
    with pytest.raises(ValueError, match="rollout_estimate"):  # the two-value form cannot do it
        rollout_advantages(samples, RolloutConfig(advantage_estimator="reinforce_plus_plus"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"advantage_estimator": "gae"}, "advantage_estimator must be one of"),
        ({"advantage_estimator": "reinforce_plus_plus", "scale_rewards": "group"}, "does not fit"),
        ({"advantage_estimator": "rloo", "scale_by_std": False}, "scale_by_std=False is grpo's"),
        ({"scale_by_std": False, "scale_rewards": "batch"}, "scale_by_std=False is grpo's"),
        ({"advantage_estimator": "reinforce_plus_plus", "leave_one_out": True}, "leave_one_out"),
        ({"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "batch"}, "normalize_then"),
        ({"multi_objective_aggregation": "mean"}, "multi_objective_aggregation must be one of"),
        ({"scale_rewards": "std"}, "scale_rewards must be one of"),
    ],
)
def test_config_refusals_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**kwargs)


def test_scale_by_std_off_is_scale_rewards_none():
    samples = _batch()
    off, _ = rollout_advantages(samples, RolloutConfig(scale_by_std=False))
    none, _ = rollout_advantages(samples, RolloutConfig(scale_rewards="none"))
    assert torch.equal(off, none) and off.tolist() == [0.5, -0.5, 0.0, 0.0]


def test_a_registered_estimator_is_selectable():
    @register_advantage_estimator("test_best_baseline", default_scale="none", scales=("none",))
    def best(inputs: AdvantageInputs, settings: EstimatorSettings) -> Estimate:
        top = torch.full((int(inputs.groups.max()) + 1,), -math.inf, dtype=torch.float64)
        top = top.scatter_reduce(0, inputs.groups, inputs.rewards, "amax")
        adv = (inputs.rewards - top[inputs.groups]).float()
        return Estimate(advantages=adv, keep=torch.ones_like(adv, dtype=torch.bool))

    try:
        adv, _ = rollout_advantages(_batch(), RolloutConfig(advantage_estimator="test_best_baseline"))
        assert adv.tolist() == [0.0, -1.0, 0.0, 0.0]
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_best_baseline")(best)
    finally:
        del ADVANTAGE_ESTIMATORS["test_best_baseline"]


def test_the_names_of_verl_and_trl_on_the_command_line():
    from interlens_mcore.cli.args import parse

    r = parse(["--adv_estimator", "reinforce_plus_plus_baseline"], "test").rollout
    assert r.advantage_estimator == "reinforce_plus_plus_baseline" and r.advantage_settings.scale == "batch"
    r = parse(["--scale_rewards", "batch", "--advantage_estimator", "rloo"], "test").rollout
    assert (r.advantage_estimator, r.advantage_settings.scale, r.advantage_settings.leave_one_out) == (
        "rloo", "batch", True,
    )  # fmt: skip
    r = parse(["--multi_objective_aggregation", "normalize_then_sum"], "test").rollout
    assert r.advantage_settings.aggregation == "normalize_then_sum"


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"])
def test_a_rank_with_no_usable_sample_still_has_the_batch_step(name):
    # its peers' all-reduces need it: the step comes from the settings, whatever the samples
    samples = _batch()
    for t in samples:
        t.status = Status.FAILED
    est = rollout_estimate(samples, RolloutConfig(advantage_estimator=name))
    assert (est.batch is not None) == (name != "rloo")
    assert not est.keep.any() and not est.advantages.any()
