import math

import pytest
import torch
from test_loss import LP, cfg, ratios_old, run

from interlens_mcore.grpo.loss.policy import POLICY_LOSSES, PolicyInputs, PolicyTerms, register_policy_loss

# The fixture of test_loss: samples 0 (tokens 0-2, A = 2) and 1 (tokens 3-4, A = -1), every
# train logprob -1. Old logprobs give the token ratios pi / pi_old = [4, 0.5, 1 | 2, 0.5].
OLD = ratios_old([4.0, 0.5, 1.0, 2.0, 0.5])
S0 = 2 ** (1 / 3)  # GSPO sample 0: exp(mean(ln 4, -ln 2, 0)) = exp(ln 2 / 3)
# GSPO sample 1: exp(mean(ln 2, -ln 2)) = 1


def test_gspo_clips_the_sequence_ratio():
    # s = [S0, S0, S0 | 1, 1]. eps 0.2, A = 2: max(-2 S0, -2 * 1.2) = -2.4 on each of sample 0's
    # tokens (clipped); sample 1: -(-1) * 1 = 1. token-mean: (-7.2 + 2) / 5 = -1.04.
    loss, grad, m = run(cfg(policy_loss="gspo"), old_logprobs=OLD)
    assert loss == pytest.approx(-1.04, abs=1e-6)
    # Clipped tokens have no gradient; on sample 1, d/dlp of -A s pi / sg(pi) = -A s = 1, / 5.
    assert grad[:5] == pytest.approx([0, 0, 0, 0.2, 0.2], abs=1e-6)
    assert m["clip/tokens_clipped"].item() == 3  # the whole sequence, not token 0 alone
    assert m["ratio/max"].item() == pytest.approx(S0)
    # Vanilla on the same token ratios clips token 0 (A > 0, r 4 > 1.2) and token 4 (A < 0,
    # r 0.5 < 0.8) only: the sequence ratio changes which tokens move.
    _, _, v = run(cfg(), old_logprobs=OLD)
    assert v["clip/tokens_clipped"].item() == 2


def test_gspo_gradient_is_sequence_level():
    # epsilon_high 0.3: S0 = 1.26 < 1.3, nothing clipped. seq-mean-token-mean:
    # (mean(-2 S0 x 3) + mean(1, 1)) / 2 = (-2 S0 + 1) / 2. Each of sample 0's tokens gets
    # -A S0 / 3 tokens / 2 sequences = -S0 / 3: one sequence weight, spread evenly.
    loss, grad, _ = run(
        cfg(policy_loss="gspo", epsilon_high=0.3, aggregation="seq-mean-token-mean"), old_logprobs=OLD
    )
    assert loss == pytest.approx((-2 * S0 + 1) / 2, abs=1e-6)
    assert grad[:5] == pytest.approx([-S0 / 3] * 3 + [0.25, 0.25], abs=1e-6)  # sample 1: 1 / 2 / 2


def test_gspo_on_policy_equals_vanilla():
    # Ratio 1 everywhere: both are -A on every token, with the same gradient.
    loss, grad, _ = run(cfg(policy_loss="gspo"))
    ref_loss, ref_grad, _ = run(cfg())
    assert loss == pytest.approx(ref_loss) and grad == pytest.approx(ref_grad)


def test_cispo_weights_every_token_with_the_clipped_ratio():
    # Cap 1 + eps_high = 1.2: weights sg(min(r, 1.2)) = [1.2, 0.5, 1, 1.2, 0.5].
    # Loss per token -A w lp with lp = -1, i.e. A w: [2.4, 1, 2, -1.2, -0.5], sum 3.7, / 5 = 0.74.
    loss, grad, m = run(cfg(policy_loss="cispo"), old_logprobs=OLD)
    assert loss == pytest.approx(0.74, abs=1e-6)
    # Gradient -A w / 5, also on the clipped tokens 0 and 3 (PPO's clip would zero token 0):
    assert grad[:5] == pytest.approx([-0.48, -0.2, -0.4, 0.24, 0.1], abs=1e-6)
    assert m["clip/tokens_clipped"].item() == 2  # r 4 and r 2 above 1.2
    # epsilon_high 4: cap 5, nothing clipped; weights are the ratios: grad -A r / 5
    _, grad, m = run(cfg(policy_loss="cispo", epsilon_high=4.0), old_logprobs=OLD)
    assert grad[:5] == pytest.approx([-1.6, -0.2, -0.4, 0.4, 0.1], abs=1e-6)
    assert m["clip/tokens_clipped"].item() == 0


def test_a_registered_policy_loss_is_selectable():
    @register_policy_loss("test-reinforce")
    def reinforce(inputs: PolicyInputs, config) -> PolicyTerms:
        none = torch.zeros_like(inputs.valid)
        per_token = torch.where(inputs.valid, -inputs.advantages * inputs.logprobs, 0.0)
        return PolicyTerms(
            per_token=per_token, ratio=inputs.ratio(config).detach(), clipped=none, dual_clipped=none
        )

    try:
        # -A lp = A with lp = -1: [2, 2, 2, -1, -1], sum 4, / 5; gradient -A / 5
        loss, grad, _ = run(cfg(policy_loss="test-reinforce"), old_logprobs=OLD)
        assert loss == pytest.approx(0.8)
        assert grad[:5] == pytest.approx([-0.4, -0.4, -0.4, 0.2, 0.2])
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test-reinforce")(reinforce)
    finally:
        POLICY_LOSSES.pop("test-reinforce")
    with pytest.raises(ValueError, match="LossConfig.policy_loss"):
        cfg(policy_loss="test-reinforce")
    with pytest.raises(ValueError, match="name"):
        register_policy_loss("")


def test_builtin_policy_losses_and_nonfinite_tokens():
    assert {"vanilla", "gspo", "cispo"} <= set(POLICY_LOSSES)
    lp = LP.clone()
    lp[0, 1] = math.nan  # dropped: GSPO's sequence mean must not read it
    for name in ("vanilla", "gspo", "cispo"):
        loss, grad, m = run(cfg(policy_loss=name), lp=lp, old_logprobs=OLD)
        assert math.isfinite(loss) and all(math.isfinite(g) for g in grad)
        assert grad[1] == 0.0 and m["nonfinite_masked"].item() == 1
    # GSPO without token 1: sample 0's s = exp(mean(ln 4, 0)) = 2 > 1.2, clipped: -2.4 on
    # tokens 0 and 2; sample 1: 1, 1. (-4.8 + 2) / 5 = -0.56
    assert run(cfg(policy_loss="gspo"), lp=lp, old_logprobs=OLD)[0] == pytest.approx(-0.56, abs=1e-6)
