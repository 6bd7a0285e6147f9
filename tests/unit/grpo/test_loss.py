import math

import pytest
import torch

from interlens_mcore.grpo.batch import TrainingBatch, block_causal_mask, build_batch
from interlens_mcore.grpo.logprobs import token_logprobs
from interlens_mcore.grpo.loss.config import LossConfig
from interlens_mcore.grpo.loss.is_weights import importance_weights
from interlens_mcore.grpo.loss.mask import denominators, is_weight_sums, loss_token_mask
from interlens_mcore.grpo.loss.metrics import empty_metrics, finalize_metrics, merge_metrics
from interlens_mcore.grpo.loss.objective import batch_loss, grpo_loss
from interlens_mcore.types import Trajectory, TurnSpan

LN2 = math.log(2)

# One packed row of 6 positions: sample 0 owns 0..2 (turn 0 = positions 0-1, turn 1 = position 2),
# sample 1 owns 3..4 (turn 2), position 5 is padding. Five loss tokens; A = 2 for sample 0,
# -1 for sample 1, so on-policy (ratio 1) the per-token policy loss -A * 1 is [-2, -2, -2, 1, 1].
SAMPLE = torch.tensor([[0, 0, 0, 1, 1, -1]])
SEGMENT = torch.tensor([[0, 0, 1, 2, 2, -1]])
MASK = torch.tensor([[True, True, True, True, True, False]])
ADV = torch.tensor([[2.0, 2.0, 2.0, -1.0, -1.0, 0.0]])
LP = torch.full((1, 6), -1.0)
# Sample 0's rollout logprobs make log(pi_train / pi_rollout) = [ln 4, -ln 2, 0]: token IS
# weights [4, 0.5, 1]. Sample 1 is incomplete: its slots are NaN and must never be read.
ROLLOUT = torch.tensor([[-1.0 - 2 * LN2, -1.0 + LN2, -1.0, math.nan, math.nan, 0.0]])
COMPLETE = torch.tensor([True, False])


def cfg(**kwargs):
    """LossConfig with the library's KL and IS turned off unless a test asks for them."""
    return LossConfig(**{"beta": 0.0, "is_mode": "none", **kwargs})


def fixture_batch(rollout=ROLLOUT, complete=COMPLETE, advantages=ADV) -> TrainingBatch:
    """The row above as a packed `TrainingBatch` (for the functions that take one)."""
    ids = torch.zeros(1, 6, dtype=torch.long)
    return TrainingBatch(
        layout="packed",
        input_ids=ids,
        position_ids=torch.tensor([[0, 1, 2, 0, 1, 0]]),
        targets=ids,
        loss_mask=MASK,
        rollout_logprobs=rollout,
        advantages=advantages,
        segment_ids=SEGMENT,
        sample_ids=SAMPLE,
        logprobs_complete=complete,
        seq_lens=torch.tensor([3, 2]),
        cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32),
        num_segments=3,
    )


def prepass_run(config, batch, lp=None, **kwargs):
    """The trainer's order: mask and denominators from a no-grad pass, then the loss with them."""
    lp = (LP if lp is None else lp).clone()
    mask = loss_token_mask(batch, lp, config)
    num_tokens, num_sequences = denominators(mask, batch).tolist()
    lp.requires_grad_(True)
    loss, metrics = batch_loss(
        lp, batch, config, token_mask=mask, num_tokens=num_tokens, num_sequences=num_sequences, **kwargs
    )
    loss.backward()
    return loss.item(), lp.grad[0].tolist(), metrics, (num_tokens, num_sequences)


def run(config, lp=None, **overrides):
    lp = (LP if lp is None else lp).clone().requires_grad_(True)
    kwargs = dict(
        loss_mask=MASK,
        advantages=ADV,
        rollout_logprobs=ROLLOUT,
        logprobs_complete=COMPLETE,
        sample_ids=SAMPLE,
        segment_ids=SEGMENT,
        config=config,
        num_tokens=5,
        num_sequences=2,
    )
    kwargs.update(overrides)
    loss, metrics = grpo_loss(lp, **kwargs)
    loss.backward()
    return loss.item(), lp.grad[0].tolist(), metrics


@pytest.mark.parametrize(
    "aggregation, num_tokens, expected",
    [
        ("token-mean", 5, -0.8),  # (-2 - 2 - 2 + 1 + 1) / 5
        ("token-mean", 10, -0.4),  # the global denominator is the caller's
        ("seq-mean-token-mean", 5, -0.5),  # (mean(-2, -2, -2) + mean(1, 1)) / 2 = (-2 + 1) / 2
        ("seq-mean-token-sum", 5, -2.0),  # (-6 + 2) / 2 sequences
    ],
)
def test_aggregations_on_policy(aggregation, num_tokens, expected):
    loss, grad, _ = run(cfg(aggregation=aggregation), num_tokens=num_tokens)
    assert loss == pytest.approx(expected)
    assert grad[5] == 0.0  # padding


def ratios_old(ratios):
    """old logprobs giving ratio pi / pi_old = `ratios` on the five loss tokens."""
    r = torch.tensor([ratios + [1.0]])
    return LP - torch.log(r)


def test_clip_clip_higher_and_dual_clip():
    old = ratios_old([1.5, 0.5, 1.0, 1.5, 0.5])
    # eps 0.2, per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   A=2,  r=1.5: max(-3, -2.4) = -2.4 (clipped)    A=2,  r=0.5: max(-1, -1.6) = -1
    #   A=2,  r=1:   -2                                 A=-1, r=1.5: max(1.5, 1.2) = 1.5
    #   A=-1, r=0.5: max(0.5, 0.8) = 0.8 (clipped)      sum -3.1, / 5 = -0.62
    loss, grad, m = run(cfg(), old_logprobs=old)
    assert loss == pytest.approx(-0.62)
    # d/dlp of -A r is -A r on unclipped tokens, 0 on clipped: [0, -1, -2, 1.5, 0] / 5
    assert grad[:5] == pytest.approx([0.0, -0.2, -0.4, 0.3, 0.0])
    assert m["clip/tokens_clipped"].item() == 2
    assert m["ratio/max"].item() == pytest.approx(1.5)
    # epsilon_high 0.6: token 0 is max(-3, -2 * 1.5) = -3, unclipped: sum -3.7, / 5 = -0.74
    loss, _, m = run(cfg(epsilon_high=0.6), old_logprobs=old)
    assert loss == pytest.approx(-0.74)
    assert m["clip/tokens_clipped"].item() == 1
    # dual clip 1.2: for A=-1 the loss is capped at -A * 1.2 = 1.2: token 3 1.5 -> 1.2.
    # sum -2.4 - 1 - 2 + 1.2 + 0.8 = -3.4, / 5 = -0.68
    loss, grad, m = run(cfg(dual_clip=1.2), old_logprobs=old)
    assert loss == pytest.approx(-0.68)
    assert grad[3] == 0.0 and m["clip/tokens_dual_clipped"].item() == 1


@pytest.mark.parametrize(
    "estimator, kl_sum",
    [
        ("k1", 0.0),  # -d = [-ln2, 0, 0, ln2, 0]
        ("k2", LN2**2),  # d^2 / 2 = [ln2^2 / 2, 0, 0, ln2^2 / 2, 0]
        ("k3", 0.5),  # e^d - d - 1 = [1 - ln2, 0, 0, ln2 - 0.5, 0]
    ],
)
def test_kl_to_reference(estimator, kl_sum):
    # d = log(pi_ref / pi) = [ln2, 0, 0, -ln2, 0]
    ref = LP + torch.tensor([[LN2, 0, 0, -LN2, 0, 0]])
    loss, _, m = run(cfg(beta=0.1, kl_estimator=estimator), ref_logprobs=ref)
    # policy -0.8 (on-policy) + 0.1 * kl_sum / 5
    assert loss == pytest.approx(-0.8 + 0.1 * kl_sum / 5, abs=1e-6)
    assert m["kl/ref_sum"].item() == pytest.approx(kl_sum, abs=1e-6)
    assert m["loss/kl"].item() == pytest.approx(0.1 * kl_sum / 5, abs=1e-6)


# Sample 0 is complete with token weights w = [4, 0.5, 1]; sample 1 is not corrected.
# The loss is (sum over sample 0 of w * -2 + 1 + 1) / 5.
# Sequence level: exp(mean(ln4, -ln2, 0)) = 2^(1/3) = 1.259921 on all three tokens.
# Turn level: turn 0 exp(mean(ln4, -ln2)) = sqrt 2 on tokens 0-1; turn 1 weight 1 on token 2.
C = 2 ** (1 / 3)
R = math.sqrt(2)


@pytest.mark.parametrize(
    "mode, threshold, weights, truncated, masked",
    [
        ("token_truncate", 2.0, [2, 0.5, 1], 1, 0),  # 4 -> 2
        ("token_mask", 2.0, [0, 0.5, 1], 0, 1),  # 4 > 2 dropped
        ("sequence_truncate", 2.0, [C, C, C], 0, 0),
        ("sequence_truncate", 1.2, [1.2, 1.2, 1.2], 3, 0),
        ("sequence_mask", 2.0, [C, C, C], 0, 0),
        ("sequence_mask", 1.2, [0, 0, 0], 0, 3),
        ("turn_truncate", 2.0, [R, R, 1], 0, 0),
        ("turn_truncate", 1.2, [1.2, 1.2, 1], 2, 0),
        ("turn_mask", 1.2, [0, 0, 1], 0, 2),
    ],
)
def test_is_modes(mode, threshold, weights, truncated, masked):
    loss, grad, m = run(cfg(is_mode=mode, is_threshold=threshold))
    expected = (sum(w * -2 for w in weights) + 2) / 5
    assert loss == pytest.approx(expected, abs=1e-6)
    # On-policy, d/dlp of w * -A * r is w * -A: weights are constants (no gradient through them).
    assert grad[:5] == pytest.approx([w * -2 / 5 for w in weights] + [0.2, 0.2], abs=1e-6)
    assert m["is/tokens_truncated"].item() == truncated
    assert m["is/tokens_masked"].item() == masked
    assert m["is/samples_corrected"].item() == 1 and m["is/tokens_corrected"].item() == 3
    assert m["is/weight_sum"].item() == pytest.approx(sum(weights), abs=1e-5)
    assert m["is/weight/max"].item() == pytest.approx(max(weights), abs=1e-6)
    assert m["nonfinite_masked"].item() == 0  # sample 1's NaN rollout slots were never read


def test_is_diagnostics_and_finalize():
    _, _, m = run(cfg(is_mode="token_truncate"))
    out = finalize_metrics(m)
    # log-ratios of the 3 compared tokens: [ln4, -ln2, 0]
    assert out["is/sample_fraction"] == 0.5 and out["is/complete_fraction"] == 0.5
    assert out["is/token_fraction"] == pytest.approx(3 / 5)
    assert out["is/weight_mean"] == pytest.approx(3.5 / 3)  # [2, 0.5, 1]
    assert out["is/truncated_fraction"] == pytest.approx(1 / 3)
    # k1 of KL(rollout || train) = mean(log rollout - log train) = -(2 ln2 - ln2) / 3
    assert out["is/kl_k1"] == pytest.approx(-LN2 / 3, abs=1e-6)
    # k3 = mean(e^x - 1 - x): (4 - 1 - 2 ln2) + (0.5 - 1 + ln2) + 0 = 2.5 - ln2
    assert out["is/kl_k3"] == pytest.approx((2.5 - LN2) / 3, abs=1e-6)
    assert out["is/abs_logprob_diff"] == pytest.approx(3 * LN2 / 3, abs=1e-6)


def test_no_is_mode_corrects_nothing_but_still_diagnoses():
    loss, _, m = run(cfg())
    assert loss == pytest.approx(-0.8)
    assert m["is/samples_corrected"].item() == 0 and m["is/tokens_corrected"].item() == 0
    assert m["is/tokens_compared"].item() == 3


def test_bypass_uses_rollout_as_old_policy():
    # Sample 0: ratio pi / pi_rollout = [4, 0.5, 1], clipped PPO with A=2:
    #   max(-8, -2.4) = -2.4, max(-1, -1.6) = -1, -2; sample 1 on-policy: 1, 1.
    #   (-2.4 - 1 - 2 + 1 + 1) / 5 = -0.68
    loss, grad, m = run(cfg(bypass=True))
    assert loss == pytest.approx(-0.68, abs=1e-6)
    assert grad[:5] == pytest.approx([0.0, -0.2, -0.4, 0.2, 0.2], abs=1e-6)
    assert m["is/samples_corrected"].item() == 1
    assert m["is/weight/max"].item() == pytest.approx(4.0)


def test_nonfinite_logprobs_are_masked_and_counted():
    lp = LP.clone()
    lp[0, 1] = math.nan
    lp[0, 3] = -math.inf
    lp[0, 5] = math.nan  # padding: not a loss token, not counted
    old = LP.clone()
    old[0, 4] = math.inf
    loss, grad, m = run(cfg(is_mode="token_truncate"), lp=lp, old_logprobs=old)
    # Left: tokens 0 (w 2) and 2 (w 1) of sample 0: (-4 - 2) / 5 = -1.2
    assert loss == pytest.approx(-1.2)
    assert all(math.isfinite(g) for g in grad)
    assert grad[1] == grad[3] == grad[4] == 0.0
    assert m["nonfinite_masked"].item() == 3
    assert all(math.isfinite(v.item()) for v in m.values())


def test_completeness_gate_is_per_sample():
    # Sample 0's gradient must not depend on whether sample 1 has complete logprobs.
    config = cfg(is_mode="sequence_truncate")
    rollout = ROLLOUT.clone()
    rollout[0, 3:5] = LP[0, 3:5] - 0.3
    _, g_mixed, _ = run(config, rollout_logprobs=rollout)
    _, g_both, m = run(config, rollout_logprobs=rollout, logprobs_complete=torch.tensor([True, True]))
    assert g_mixed[:3] == pytest.approx(g_both[:3])
    assert g_mixed[3:5] != pytest.approx(g_both[3:5])  # sample 1 is corrected only when complete
    assert m["is/samples_corrected"].item() == 2


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"beta": -1.0}, "beta"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"aggregation": "token-max"}, "aggregation"),
        ({"is_mode": "segment_mask"}, "is_mode"),
        ({"is_threshold": 0.0}, "is_threshold"),
        ({"bypass": True, "is_mode": "token_mask"}, "is_mode"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
    ],
)
def test_config_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LossConfig(**kwargs)
    with pytest.raises(TypeError):
        LossConfig(0.2)  # keyword-only


@pytest.mark.parametrize(
    "config, overrides, name",
    [
        (cfg(), {"advantages": ADV[:, :5]}, "advantages"),
        (cfg(), {"sample_ids": SAMPLE[0]}, "sample_ids"),
        (cfg(), {"old_logprobs": LP[:, :3]}, "old_logprobs"),
        (cfg(), {"logprobs_complete": COMPLETE.float()}, "logprobs_complete"),
        (cfg(), {"num_tokens": 0}, "num_tokens"),
        (cfg(), {"num_sequences": 0}, "num_sequences"),
        (cfg(beta=0.1), {}, "ref_logprobs"),
        (cfg(is_mode="turn_mask"), {"segment_ids": None}, "segment_ids"),
    ],
)
def test_bad_loss_input(config, overrides, name):
    with pytest.raises(ValueError, match=name):
        run(config, **overrides)


def test_empty_logprobs_and_unknown_is_mode():
    with pytest.raises(ValueError, match="logprobs"):
        run(cfg(), lp=torch.zeros(1, 0), loss_mask=MASK[:, :0])
    with pytest.raises(ValueError, match="mode"):
        importance_weights(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), mode="token", threshold=2.0)


def test_merge_metrics_sums_and_maxes():
    _, _, a = run(cfg(is_mode="token_truncate"))
    _, _, b = run(cfg(is_mode="token_truncate", is_threshold=5.0))
    merged = merge_metrics(a, b)
    assert merged["tokens"].item() == 10
    assert merged["is/weight/max"].item() == pytest.approx(4.0)  # max(2, 4), not 6
    with pytest.raises(ValueError, match="keys"):
        merge_metrics(a, {"tokens": a["tokens"]})


def _trajectories(vocab, centre=None):
    """Three samples; rollout logprobs uniform in [-3, 0], or within 0.75 of `centre`."""
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    def lps(n):
        u = torch.rand(n, generator=g)
        return (-u * 3 if centre is None else centre + (u - 0.5) * 1.5).tolist()

    def span(s, e):
        return TurnSpan(start=s, end=e, speaker="policy", trained=True)

    # 1: prompt 4, turn 3, env 2, turn 4 (complete)  2: prompt 3, turn 5 (no logprobs)
    # 3: prompt 2, turn 2, env 3, turn 2, env 1 (complete)
    return [
        Trajectory(token_ids=ids(13), loss_mask=[0] * 4 + [1] * 3 + [0] * 2 + [1] * 4,
                   rollout_logprobs=lps(7), turns=[span(4, 7), span(9, 13)]),
        Trajectory(token_ids=ids(8), loss_mask=[0] * 3 + [1] * 5, rollout_logprobs=None, turns=[span(3, 8)]),
        Trajectory(token_ids=ids(10), loss_mask=[0, 0, 1, 1, 0, 0, 0, 1, 1, 0], rollout_logprobs=lps(4),
                   turns=[span(2, 4), span(7, 9)]),
    ]  # fmt: skip


def _model_loss_and_grads(model, batch, config):
    model.zero_grad()
    if batch.layout == "packed":
        attn = block_causal_mask(batch.sample_ids)  # [1, 1, T, T]: samples do not see each other
    else:
        attn = batch.sample_ids >= 0  # [N, T] right padding
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=attn).logits
    lp = token_logprobs(logits, batch.targets, temperature=0.9)
    ref = lp.detach() + 0.05 * torch.cos(batch.targets.float())  # a fixed, layout-independent offset
    loss, metrics = batch_loss(
        lp, batch, config, ref_logprobs=ref, num_tokens=batch.num_loss_tokens, num_sequences=batch.num_samples
    )
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}, metrics


@pytest.mark.parametrize(
    "config",
    [
        cfg(is_mode="turn_truncate", is_threshold=1.5, beta=0.1, aggregation="seq-mean-token-mean"),
        cfg(is_mode="token_mask", kl_estimator="k2", beta=0.05, epsilon_high=0.28),
    ],
)
def test_packed_and_padded_give_the_same_loss_and_gradients(tiny, config):
    model, _ = tiny
    trajs = _trajectories(model.config.vocab_size)
    adv = [1.0, -0.5, 0.25]
    packed = build_batch(trajs, adv, layout="packed", pad_to_multiple=8)
    padded = build_batch(trajs, adv, layout="padded", pad_to_multiple=8)
    loss_p, grads_p, m_p = _model_loss_and_grads(model, packed, config)
    loss_d, grads_d, m_d = _model_loss_and_grads(model, padded, config)
    assert loss_p.abs() > 0
    torch.testing.assert_close(loss_p, loss_d, rtol=1e-5, atol=1e-6)
    for name in grads_p:
        torch.testing.assert_close(grads_p[name], grads_d[name], rtol=1e-4, atol=1e-6, msg=name)
    assert m_p["is/samples_corrected"].item() == m_d["is/samples_corrected"].item() == 2
    for key in m_p:
        torch.testing.assert_close(m_p[key], m_d[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_dropped_token_leaves_both_denominators(layout):
    # One sample of 3 tokens whose last 2 train (A = 1); its second loss token has a NaN
    # logprob. On-policy each kept token's loss is -A * 1 = -1. Counting the NaN token, as the
    # loss-mask denominators do, gives -1 / 2 = -0.5; the pre-pass counts 1 token and 1
    # sequence, so the loss is -1 / 1 = -1 under token-mean and seq-mean-token-sum alike.
    batch = build_batch(
        [Trajectory(token_ids=[5, 6, 7], loss_mask=[0, 1, 1], rollout_logprobs=None)], [1.0], layout=layout
    )
    lp = torch.full(batch.loss_mask.shape, -1.0)
    lp[batch.loss_mask.nonzero()[1].unbind()] = math.nan  # the second loss token
    config = cfg()
    mask = loss_token_mask(batch, lp, config)
    assert denominators(mask, batch).tolist() == [1.0, 1.0]
    assert denominators(batch.loss_mask, batch).tolist() == [2.0, 1.0]  # what the trainer counts today
    for aggregation in ("token-mean", "seq-mean-token-sum"):
        c = cfg(aggregation=aggregation)
        loss, m = batch_loss(lp, batch, c, token_mask=mask, num_tokens=1, num_sequences=1)
        assert loss.item() == pytest.approx(-1.0)
        assert m["nonfinite_masked"].item() == 1 and m["tokens_kept"].item() == 1
        old, _ = batch_loss(lp, batch, c, num_tokens=2, num_sequences=1)
        assert old.item() == pytest.approx(-0.5 if aggregation == "token-mean" else -1.0)


def test_token_mask_must_lie_within_the_loss_mask():
    batch = fixture_batch()
    outside = torch.ones_like(MASK)  # position 5 is padding
    with pytest.raises(ValueError, match="token_mask"):
        batch_loss(LP, batch, cfg(), token_mask=outside, num_tokens=5, num_sequences=2)
    with pytest.raises(ValueError, match="token_mask"):
        batch_loss(LP, batch, cfg(), token_mask=MASK.float(), num_tokens=5, num_sequences=2)


def test_without_token_mask_the_loss_is_unchanged_by_the_prepass_functions():
    # No dropped token: the pre-pass mask is the loss mask and the denominators are the
    # trainer's (5 tokens, 2 samples), so both paths give the same loss and metrics.
    config = cfg(is_mode="token_truncate")
    loss, grad, m, counts = prepass_run(config, fixture_batch())
    ref_loss, ref_grad, ref_m = run(config)
    assert counts == (5.0, 2.0)
    assert loss == pytest.approx(ref_loss) and grad == pytest.approx(ref_grad)
    for key in m:
        torch.testing.assert_close(m[key], ref_m[key], msg=key)


def test_config_defaults_are_the_command_line_defaults():
    c = LossConfig()
    assert (c.epsilon, c.epsilon_high, c.dual_clip, c.beta) == (0.2, None, None, 0.1)
    assert (c.kl_estimator, c.aggregation, c.is_mode, c.is_threshold, c.bypass) == (
        "k3",
        "token-mean",
        "token_truncate",
        2.0,
        False,
    )
    # every option that is new is off by default
    assert (c.policy_loss, c.rejection, c.is_sequence_weight) == ("vanilla", "none", "geometric")
    assert c.kl_clamp is c.is_threshold_low is c.off_policy_sequence_mask_delta is c.loss_scale_factor is None
    assert not (c.kl_is_weighted or c.is_batch_normalize or c.rejects)
    assert LossConfig(is_mode=None).is_mode == "none"  # Python's off is the command line's


def test_command_line_is_generated_from_the_config():
    from dataclasses import fields

    from transformers import HfArgumentParser

    assert all(f.metadata.get("help") for f in fields(LossConfig))
    parser = HfArgumentParser(LossConfig)
    (default,) = parser.parse_args_into_dataclasses([])
    assert default == LossConfig()
    argv = "--policy-loss gspo --kl-estimator k3+ --kl-clamp 10 --kl-is-weighted --is-mode none "
    argv += "--aggregation seq-mean-token-sum-norm --loss-scale-factor 64 --rejection sequence "
    argv += "--rejection-threshold 2 --off-policy-sequence-mask-delta 0.5 --epsilon-high 0.28"
    (c,) = parser.parse_args_into_dataclasses(argv.split())
    assert c == LossConfig(
        policy_loss="gspo",
        kl_estimator="k3+",
        kl_clamp=10.0,
        kl_is_weighted=True,
        is_mode="none",
        aggregation="seq-mean-token-sum-norm",
        loss_scale_factor=64.0,
        rejection="sequence",
        rejection_threshold=2.0,
        off_policy_sequence_mask_delta=0.5,
        epsilon_high=0.28,
    )
    with pytest.raises(SystemExit):  # a mode outside its Literal is refused by the parser itself
        parser.parse_args_into_dataclasses(["--rejection", "tokens"])


def test_metric_keys_do_not_depend_on_the_config():
    keys = set(empty_metrics())
    configs = [
        cfg(),
        cfg(policy_loss="cispo", is_mode="turn_mask"),
        cfg(rejection="token", rejection_threshold=2),
    ]
    for config in configs:
        _, _, m = run(config)
        assert set(m) == keys
    assert empty_metrics()["is/weight/min"].item() == math.inf  # the neutral value of a min
    out = finalize_metrics(empty_metrics())
    assert all(math.isfinite(v) for v in out.values()) and out["is/weight/min"] == 0.0


def _prepass_loss_and_grads(model, batch, config):
    """The trainer's order: a no-grad pass decides the mask, denominators and IS weight mean."""
    model.zero_grad()
    if batch.layout == "packed":
        attn = block_causal_mask(batch.sample_ids)
    else:
        attn = batch.sample_ids >= 0
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=attn).logits
    lp = token_logprobs(logits, batch.targets, temperature=0.9)
    offset = 0.3 * torch.sin(batch.targets.float())  # fixed per target id, so layout-independent
    old, ref = lp.detach() - offset, lp.detach() + 0.2 * torch.cos(batch.targets.float())
    mask = loss_token_mask(batch, old, config, ref_logprobs=ref)
    num_tokens, num_sequences = denominators(mask, batch).tolist()
    kwargs = {}
    if config.is_batch_normalize:
        total, count = is_weight_sums(batch, old, mask, config).tolist()
        kwargs["is_weight_mean"] = total / count
    loss, metrics = batch_loss(
        lp, batch, config, token_mask=mask, old_logprobs=old, ref_logprobs=ref,
        num_tokens=num_tokens, num_sequences=num_sequences, **kwargs,
    )  # fmt: skip
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}, metrics


NEW_MODES = [
    LossConfig(policy_loss="gspo", aggregation="seq-mean-token-mean", beta=0.1),
    LossConfig(policy_loss="cispo", epsilon_high=0.28, beta=0.1, kl_estimator="abs"),
    LossConfig(aggregation="token-sum", beta=0.1, kl_estimator="k1+"),
    LossConfig(aggregation="seq-mean-token-sum-norm", loss_scale_factor=16.0, beta=0.1, kl_estimator="k3+"),
    LossConfig(is_mode="token_mask", is_threshold=1.5, is_threshold_low=0.7, beta=0.1, kl_clamp=0.01),
    LossConfig(is_mode="sequence_truncate", is_threshold=1.2, is_sequence_weight="product", beta=0.0),
    LossConfig(
        is_mode="turn_truncate", is_sequence_weight="product", is_batch_normalize=True, kl_is_weighted=True
    ),
    LossConfig(is_mode="none", beta=0.0, rejection="token", rejection_threshold=1.5),
    LossConfig(is_mode="none", beta=0.0, rejection="sequence", rejection_threshold=1.1),
    LossConfig(rejection="sequence_k1", rejection_threshold=0.1, aggregation="seq-mean-token-mean"),
    LossConfig(rejection="sequence_k3", rejection_threshold=0.15, aggregation="seq-mean-token-sum"),
    LossConfig(off_policy_sequence_mask_delta=0.0, policy_loss="gspo"),
]


@pytest.mark.parametrize("config", NEW_MODES, ids=range(len(NEW_MODES)))
def test_packed_and_padded_agree_for_every_new_mode(tiny, config):
    model, _ = tiny
    # rollout logprobs near the tiny model's (about -6.3), so ratios sit around 1 and the
    # thresholds above cut some tokens, not all
    trajs = _trajectories(model.config.vocab_size, centre=-6.3)
    adv = [1.0, -0.5, -0.75]
    packed = build_batch(trajs, adv, layout="packed", pad_to_multiple=8)
    padded = build_batch(trajs, adv, layout="padded", pad_to_multiple=8)
    loss_p, grads_p, m_p = _prepass_loss_and_grads(model, packed, config)
    loss_d, grads_d, m_d = _prepass_loss_and_grads(model, padded, config)
    assert loss_p.abs() > 0
    torch.testing.assert_close(loss_p, loss_d, rtol=1e-5, atol=1e-6)
    for name in grads_p:
        torch.testing.assert_close(grads_p[name], grads_d[name], rtol=1e-4, atol=1e-6, msg=name)
    for key in m_p:
        torch.testing.assert_close(m_p[key], m_d[key], rtol=1e-4, atol=1e-5, msg=key)
    if config.rejects:  # the rule acted, and not on every sample it could measure
        assert 0 < m_p["is/tokens_rejected"].item() < m_p["is/tokens_compared"].item()


def test_prepass_bad_input():
    batch = fixture_batch()
    with pytest.raises(ValueError, match="logprobs"):
        loss_token_mask(batch, LP[:, :5], cfg())
    with pytest.raises(ValueError, match="ref_logprobs"):
        loss_token_mask(batch, LP, cfg(), ref_logprobs=LP[:, :5])
    with pytest.raises(ValueError, match="mask"):
        denominators(MASK.float(), batch)
    with pytest.raises(ValueError, match="is_mode"):
        is_weight_sums(batch, LP, MASK, cfg())
