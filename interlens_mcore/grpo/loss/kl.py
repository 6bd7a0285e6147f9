"""Per-token estimators of KL(train || reference) from tokens sampled by the train policy.

With d = log pi_ref - log pi (per token): k1 = -d, k2 = d^2 / 2, k3 = e^d - d - 1 (unbiased,
always >= 0, low variance), abs = |d|. The straight-through variants 'k1+' and 'k3+' report
the k1 / k3 value but take the gradient of k2, whose gradient in log pi is the unbiased
gradient of KL(train || reference); in expectation the gradient of k1 is zero and that of
k3 is the gradient of the reverse KL(reference || train).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

KLEstimator = Literal["k1", "k2", "k3", "abs", "k1+", "k3+"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


def _value(d: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - d - 1
    return d.abs()


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str,
    clamp: float,
    output_clamp: float | None = None,
) -> torch.Tensor:
    """[B, T] KL estimate per token; differentiable in `logprobs`.

    `clamp` bounds d before exp (e^20 is large but finite in fp32). `output_clamp` bounds the
    estimate to [-output_clamp, output_clamp] (k3 can still reach e^clamp on one token); a
    clamped token has no gradient, as with any clamp. For the '+' variants it bounds the
    reported value only: the k2 gradient passes through.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    d = (ref_logprobs - logprobs).clamp(-clamp, clamp)  # log(pi_ref / pi)
    value = _value(d, estimator.rstrip("+"))
    if output_clamp is not None:
        value = value.clamp(-output_clamp, output_clamp)
    if not estimator.endswith("+"):
        return value
    k2 = 0.5 * d * d
    return value.detach() + (k2 - k2.detach())  # value of k1 / k3, gradient of k2
