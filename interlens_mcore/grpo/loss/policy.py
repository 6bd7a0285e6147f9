"""Policy surrogates (per-token losses before IS weights and aggregation) and their registry.

A policy loss maps `PolicyInputs` and the `LossConfig` to `PolicyTerms`. Three are built in:
'vanilla' (PPO's clipped ratio, with clip-higher and dual-clip), 'gspo' (one ratio per
sequence, the geometric mean of its token ratios, clipped as a whole) and 'cispo' (the
clipped ratio as a constant weight on the log-likelihood of every token, clipped or not).
Add one with `register_policy_loss`; `LossConfig(policy_loss=NAME)` then selects it:

    @register_policy_loss("reinforce")
    def reinforce(inputs: PolicyInputs, config: PolicyConfig) -> PolicyTerms:
        none = torch.zeros_like(inputs.valid)
        per_token = torch.where(inputs.valid, -inputs.advantages * inputs.logprobs, 0.0)
        return PolicyTerms(per_token=per_token, ratio=inputs.ratio(config).detach(),
                           clipped=none, dual_clipped=none)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .aggregation import broadcast, unit_means


class PolicyConfig(Protocol):
    """The `LossConfig` fields the built-in policy losses read (a `LossConfig` is passed). A
    protocol: `config` imports this module to check `LossConfig.policy_loss`, so this module
    imports nothing of `config`."""

    @property
    def epsilon(self) -> float: ...

    @property
    def epsilon_high(self) -> float | None: ...

    @property
    def dual_clip(self) -> float | None: ...

    @property
    def log_ratio_clamp(self) -> float: ...


@dataclass(frozen=True, kw_only=True)
class PolicyInputs:
    """The tensors a surrogate reads; every [B, T] one is 0 off `valid`."""

    logprobs: torch.Tensor  # [B, T] float32 train-policy logprobs, differentiable
    old_logprobs: torch.Tensor  # [B, T] float32 behaviour policy of the PPO ratio, no gradient
    advantages: torch.Tensor  # [B, T] float32
    valid: torch.Tensor  # [B, T] bool, the tokens in the loss
    sample_ids: torch.Tensor  # [B, T] int64, sample owning each position; -1 on padding
    num_samples: int  # N: sample ids are 0..N-1

    def ratio(self, config: PolicyConfig) -> torch.Tensor:
        """[B, T] pi / pi_old per token; the log-ratio is clamped so exp stays finite in fp32."""
        c = config.log_ratio_clamp
        return torch.exp((self.logprobs - self.old_logprobs).clamp(-c, c))


@dataclass(frozen=True, kw_only=True)
class PolicyTerms:
    per_token: torch.Tensor  # [B, T] loss per token, 0 off valid; IS weights multiply it later
    ratio: torch.Tensor  # [B, T] the ratio behind it (detached), for `ratio/max`
    clipped: torch.Tensor  # [B, T] bool, tokens the clip acted on
    dual_clipped: torch.Tensor  # [B, T] bool, tokens the dual-clip cap acted on


PolicyLoss = Callable[[PolicyInputs, PolicyConfig], PolicyTerms]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator adding a policy loss under `name` (a name already taken is an error)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy loss name must be a non-empty string, got {name!r}")

    def add(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(
                f"policy loss {name!r} is already registered ({POLICY_LOSSES[name].__qualname__})"
            )
        POLICY_LOSSES[name] = fn
        return fn

    return add


def _clipped(ratio: torch.Tensor, inputs: PolicyInputs, config: PolicyConfig) -> PolicyTerms:
    """max(-A r, -A clip(r, 1 - eps, 1 + eps_high)), then for A < 0 at most -A * dual_clip."""
    adv, valid = inputs.advantages, inputs.valid
    eps_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1 - config.epsilon, 1 + eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = valid & (pg2 > pg1)
    dual = torch.zeros_like(valid)
    if config.dual_clip is not None:
        cap = -adv * config.dual_clip  # > 0 exactly where A < 0
        dual = valid & (adv < 0) & (pg > cap)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    per_token = torch.where(valid, pg, 0.0)
    return PolicyTerms(per_token=per_token, ratio=ratio.detach(), clipped=clipped, dual_clipped=dual)


@register_policy_loss("vanilla")
def vanilla(inputs: PolicyInputs, config: PolicyConfig) -> PolicyTerms:
    """PPO / GRPO: the token ratio pi / pi_old, clipped."""
    return _clipped(inputs.ratio(config), inputs, config)


@register_policy_loss("gspo")
def gspo(inputs: PolicyInputs, config: PolicyConfig) -> PolicyTerms:
    """GSPO: s = exp(mean over the sample's tokens of log(pi / pi_old)), clipped per sequence.

    Written token-wise as s * pi / sg(pi): the value is s on every token of the sample, and with
    one advantage per sample and 'seq-mean-token-mean' the gradient is the sequence-level one,
    -A s mean(grad log pi); token-level advantages also work. Clip ranges in GSPO are much
    smaller than PPO's (its paper: 3e-4 / 4e-4), because s averages the token ratios.
    """
    c = config.log_ratio_clamp
    lp, valid = inputs.logprobs, inputs.valid
    mean, _ = unit_means((lp - inputs.old_logprobs).detach(), valid, inputs.sample_ids, inputs.num_samples)
    seq = broadcast(mean, inputs.sample_ids)  # [B, T] log s of each position's sample
    ratio = torch.exp((lp - lp.detach() + seq).clamp(-c, c))
    return _clipped(ratio, inputs, config)


@register_policy_loss("cispo")
def cispo(inputs: PolicyInputs, config: PolicyConfig) -> PolicyTerms:
    """CISPO: -A * sg(min(r, 1 + eps_high)) * log pi on every token.

    The clip bounds the weight, not the update: clipped tokens still get a gradient (PPO's clip
    zeroes it), so rare high-ratio tokens keep contributing. The value is A-weighted
    log-likelihood, not a ratio, so it is not comparable to the vanilla loss.
    """
    eps_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    ratio = inputs.ratio(config).detach()
    weight = ratio.clamp(max=1 + eps_high)
    per_token = torch.where(inputs.valid, -inputs.advantages * weight * inputs.logprobs, 0.0)
    clipped = inputs.valid & (ratio > 1 + eps_high)
    return PolicyTerms(
        per_token=per_token, ratio=ratio, clipped=clipped, dual_clipped=torch.zeros_like(clipped)
    )
