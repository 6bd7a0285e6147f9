import math

import pytest
import torch
from test_loss import LP, cfg, run

from interlens_mcore.grpo.loss.kl import kl_penalty

LN2 = math.log(2)
# d = log pi_ref - log pi = [ln 2, -ln 2, 0] at log pi = 0.
REF = torch.tensor([LN2, -LN2, 0.0])


def kl_and_grad(estimator, ref=REF, output_clamp=None):
    lp = torch.zeros_like(ref, requires_grad=True)
    kl = kl_penalty(lp, ref, estimator, 20.0, output_clamp)
    kl.sum().backward()
    return kl.detach().tolist(), lp.grad.tolist()


@pytest.mark.parametrize(
    "estimator, value, grad",
    [
        # k1 = -d; d/dlp (-(ref - lp)) = 1
        ("k1", [-LN2, LN2, 0], [1, 1, 1]),
        # k2 = d^2 / 2; gradient -d
        ("k2", [LN2**2 / 2, LN2**2 / 2, 0], [-LN2, LN2, 0]),
        # k3 = e^d - d - 1 = [1 - ln 2, ln 2 - 0.5, 0]; gradient -(e^d - 1) = [-1, 0.5, 0]
        ("k3", [1 - LN2, LN2 - 0.5, 0], [-1, 0.5, 0]),
        # abs = |d|; gradient -sign(d) (0 at d = 0)
        ("abs", [LN2, LN2, 0], [-1, 1, 0]),
        # straight-through: the k1 / k3 value, the k2 gradient -d
        ("k1+", [-LN2, LN2, 0], [-LN2, LN2, 0]),
        ("k3+", [1 - LN2, LN2 - 0.5, 0], [-LN2, LN2, 0]),
    ],
)
def test_estimators_values_and_gradients(estimator, value, grad):
    v, g = kl_and_grad(estimator)
    assert v == pytest.approx(value, abs=1e-6)
    assert g == pytest.approx(grad, abs=1e-6)


def test_output_clamp():
    # d = 15: k3 = e^15 - 16 = 3.27e6 on one token; clamped to 10 it has no gradient, while
    # k3+ keeps the k2 gradient -d = -15 under the same bound on its value.
    ref = torch.tensor([15.0, LN2])
    v, g = kl_and_grad("k3", ref)
    assert v[0] == pytest.approx(math.exp(15) - 16, rel=1e-5)
    v, g = kl_and_grad("k3", ref, output_clamp=10.0)
    assert v == pytest.approx([10.0, 1 - LN2], abs=1e-6) and g == pytest.approx([0.0, -1.0], abs=1e-6)
    v, g = kl_and_grad("k3+", ref, output_clamp=10.0)
    assert v == pytest.approx([10.0, 1 - LN2], abs=1e-6) and g == pytest.approx([-15.0, -LN2], abs=1e-6)
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4", 20.0)


def test_kl_clamp_and_is_weights_in_the_loss():
    # d = [ln 2, 0, 0, -ln 2, 0] on the five loss tokens; k3 = [1 - ln 2, 0, 0, ln 2 - 0.5, 0],
    # sum 0.5. token_truncate at 2 gives IS weights [2, 0.5, 1] on sample 0, 1 on sample 1.
    ref = LP + torch.tensor([[LN2, 0, 0, -LN2, 0, 0]])
    base = dict(beta=0.1, is_mode="token_truncate")
    _, _, m = run(cfg(**base), ref_logprobs=ref)
    assert m["loss/kl"].item() == pytest.approx(0.1 * 0.5 / 5, abs=1e-6)  # not weighted (verl, TRL)
    # weighted (ms-swift): 2 (1 - ln 2) + 1 (ln 2 - 0.5) = 1.5 - ln 2
    loss, _, m = run(cfg(kl_is_weighted=True, **base), ref_logprobs=ref)
    assert m["loss/kl"].item() == pytest.approx(0.1 * (1.5 - LN2) / 5, abs=1e-6)
    assert m["kl/ref_sum"].item() == pytest.approx(0.5, abs=1e-6)  # the diagnostic is unweighted
    # kl_clamp 0.25 bounds token 0 (0.307) and token 3 (0.193 stays): (0.25 + 0.193) / 5
    _, _, m = run(cfg(kl_clamp=0.25, **base), ref_logprobs=ref)
    assert m["kl/ref_sum"].item() == pytest.approx(0.25 + LN2 - 0.5, abs=1e-6)
    # abs estimator through the loss: |d| sums to 2 ln 2
    _, _, m = run(cfg(beta=0.1, kl_estimator="abs"), ref_logprobs=ref)
    assert m["kl/ref_sum"].item() == pytest.approx(2 * LN2, abs=1e-6)
    with pytest.raises(ValueError, match="LossConfig.kl_clamp"):
        cfg(kl_clamp=0.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs", "k1+", "k3+"])
def test_log_ratio_bound_stops_the_gradient_beyond_it(estimator):
    # d = log(pi_ref / pi) is bounded to [-20, 20] before every estimator (the README states it;
    # verl bounds d in k3 only): at |d| = 25 the value is that of |d| = 20 and the gradient is 0,
    # while at |d| = 19 it flows.
    ref = torch.tensor([25.0, -25.0, 19.0])
    v, g = kl_and_grad(estimator, ref)
    at_bound, _ = kl_and_grad(estimator, torch.tensor([20.0, -20.0, 19.0]))
    assert v == pytest.approx(at_bound, rel=1e-6)
    assert g[:2] == [0.0, 0.0] and g[2] != 0.0
