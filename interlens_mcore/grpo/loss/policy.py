"""Policy surrogates (per-token losses before IS weights and aggregation) and their registry.

A policy loss maps `PolicyInputs` and the `LossConfig` to `PolicyTerms`. Built in: 'vanilla'
(PPO's clipped ratio, with clip-higher and dual-clip), 'gspo' (one ratio per sequence, the
geometric mean of its token ratios, clipped as a whole), 'cispo' (the clipped ratio as a
constant weight on the log-likelihood of every token, clipped or not), 'cispo_seq' (the same
with GSPO's sequence ratio), 'sapo' (a sigmoid gate instead of the clip), 'geo_mean' (GMPO:
the geometric mean of the clipped token ratios), 'clip_cov' and 'kl_cov' (PPO without, or
with a KL penalty on, the few tokens whose advantage and logprob covary most).
Add one with `register_policy_loss`; `LossConfig(policy_loss=NAME)` then selects it:

    @register_policy_loss("reinforce")
    def reinforce(inputs: PolicyInputs, config: PolicyConfig) -> PolicyTerms:
        none = torch.zeros_like(inputs.valid)
        per_token = torch.where(inputs.valid, -inputs.advantages * inputs.logprobs, 0.0)
        return PolicyTerms(per_token=per_token, ratio=inputs.ratio(config).detach(),
                           clipped=none, dual_clipped=none)
"""

from __future__ import annotations

import math
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

    @property
    def sapo_temperature_pos(self) -> float: ...

    @property
    def sapo_temperature_neg(self) -> float: ...

    @property
    def clip_cov_ratio(self) -> float: ...

    @property
    def clip_cov_lb(self) -> float: ...

    @property
    def clip_cov_ub(self) -> float: ...

    @property
    def kl_cov_ratio(self) -> float: ...

    @property
    def ppo_kl_coef(self) -> float: ...


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


def _sequence_log_ratio(inputs: PolicyInputs) -> torch.Tensor:
    """[B, T] (detached) mean over each position's sample of log(pi / pi_old): log s of GSPO."""
    diff = (inputs.logprobs - inputs.old_logprobs).detach()
    mean, _ = unit_means(diff, inputs.valid, inputs.sample_ids, inputs.num_samples)
    return broadcast(mean, inputs.sample_ids)


@register_policy_loss("cispo_seq")
def cispo_seq(inputs: PolicyInputs, config: PolicyConfig) -> PolicyTerms:
    """Sequence-level CISPO: -A * sg(min(s, 1 + eps_high)) * log pi, s the GSPO sequence ratio.

    TRL's and ms-swift's `loss_type="cispo"` with `importance_sampling_level="sequence"`: one
    weight per sample (the geometric mean of its token ratios, capped), on every token's
    log-likelihood. TRL caps at `epsilon_high` itself; here the cap is 1 + epsilon_high as
    for 'cispo' (TRL's 5.0 is our 4.0)."""
    c = config.log_ratio_clamp
    eps_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    ratio = torch.exp(_sequence_log_ratio(inputs).clamp(-c, c))
    weight = ratio.clamp(max=1 + eps_high)
    per_token = torch.where(inputs.valid, -inputs.advantages * weight * inputs.logprobs, 0.0)
    clipped = inputs.valid & (ratio > 1 + eps_high)
    return PolicyTerms(
        per_token=per_token, ratio=ratio, clipped=clipped, dual_clipped=torch.zeros_like(clipped)
    )


@register_policy_loss("sapo")
def sapo(inputs: PolicyInputs, config: PolicyConfig) -> PolicyTerms:
    """SAPO: -A * (4 / tau) * sigmoid(tau * (r - 1)) per token, r the token ratio.

    A smooth gate in place of the clip: at r = 1 its value is 2 / tau and its slope in r is 1
    (PPO's), and the gradient fades as r leaves 1 instead of stopping at 1 +- eps. tau is
    `sapo_temperature_pos` where A > 0 and `sapo_temperature_neg` elsewhere (TRL's names;
    verl's `tau_pos` / `tau_neg`); a larger tau narrows the gate. No token counts as clipped.
    """
    ratio = inputs.ratio(config)
    adv = inputs.advantages
    tau = torch.where(adv > 0, config.sapo_temperature_pos, config.sapo_temperature_neg)
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    per_token = torch.where(inputs.valid, -adv * gate, 0.0)
    none = torch.zeros_like(inputs.valid)
    return PolicyTerms(per_token=per_token, ratio=ratio.detach(), clipped=none, dual_clipped=none)


@register_policy_loss("geo_mean")
def geo_mean(inputs: PolicyInputs, config: PolicyConfig) -> PolicyTerms:
    """GMPO (verl's 'geo_mean'): -A * exp(mean over the sample of the clipped log-ratios).

    Each token's log-ratio d is clipped in log space on the side the advantage's sign makes
    harmful: for A > 0 at most epsilon_high, for A < 0 at least -epsilon (so epsilon 0.4 means
    the ratio range [e^-0.4, e^0.4] of the GMPO paper). The sample's ratio R is the exponential
    of the mean clipped d, with gradient (R / n) on each unclipped token. Every token of the
    sample holds the sequence value -A R, so 'seq-mean-token-mean' gives verl's loss (the mean
    over sequences of -A R); the advantage used is the sample's mean advantage.
    """
    c = config.log_ratio_clamp
    eps_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    valid, ids, n = inputs.valid, inputs.sample_ids, inputs.num_samples
    d = (inputs.logprobs - inputs.old_logprobs).clamp(-c, c)
    pos = inputs.advantages > 0
    neg = inputs.advantages < 0
    clipped_d = torch.where(pos, d.clamp(max=eps_high), torch.where(neg, d.clamp(min=-config.epsilon), d))
    clipped = valid & ((pos & (d > eps_high)) | (neg & (d < -config.epsilon)))
    mean_d, _ = unit_means(clipped_d, valid, ids, n)
    mean_adv, _ = unit_means(inputs.advantages, valid, ids, n)
    ratio = broadcast(torch.exp(mean_d), ids, fill=1.0)
    per_token = torch.where(valid, -broadcast(mean_adv, ids) * ratio, 0.0)
    return PolicyTerms(
        per_token=per_token, ratio=ratio.detach(), clipped=clipped, dual_clipped=torch.zeros_like(clipped)
    )


def _covariance(inputs: PolicyInputs) -> torch.Tensor:
    """[B, T] (A - mean A) * (log pi - mean log pi) over the call's valid tokens, detached."""
    valid = inputs.valid
    count = valid.sum().clamp(min=1)
    adv = inputs.advantages.detach()
    lp = inputs.logprobs.detach()
    mean_adv = torch.where(valid, adv, 0.0).sum() / count
    mean_lp = torch.where(valid, lp, 0.0).sum() / count
    return torch.where(valid, (adv - mean_adv) * (lp - mean_lp), 0.0)


@register_policy_loss("clip_cov")
def clip_cov(inputs: PolicyInputs, config: PolicyConfig) -> PolicyTerms:
    """Clip-Cov (verl 'clip_cov'): PPO's clipped loss, and no gradient on a few high-covariance tokens.

    Among the call's valid tokens that PPO's clip left alone and whose covariance
    (A - mean A)(log pi - mean log pi) lies in (clip_cov_lb, clip_cov_ub), max(1,
    int(clip_cov_ratio * valid tokens)) are drawn at random and contribute nothing (their value
    and gradient are 0; the denominators still count them). The draw uses a generator seeded by
    the call's valid-token count, so every TP rank, holding the same tensors, draws the same
    tokens. Dropped tokens count as clipped (verl's `pg_clipfrac` counts them alone).
    """
    valid = inputs.valid
    terms = _clipped(inputs.ratio(config), inputs, config)
    cov = _covariance(inputs)
    candidate = valid & ~terms.clipped & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    idx = torch.nonzero(candidate.flatten()).flatten()
    drop = torch.zeros_like(valid).flatten()
    if idx.numel():
        k = max(int(config.clip_cov_ratio * int(valid.sum())), 1)
        gen = torch.Generator().manual_seed(int(valid.sum()))
        pick = torch.randperm(idx.numel(), generator=gen)[:k].to(idx.device)
        drop[idx[pick]] = True
    drop = drop.view_as(valid)
    per_token = torch.where(drop, 0.0, terms.per_token)
    return PolicyTerms(
        per_token=per_token, ratio=terms.ratio, clipped=terms.clipped | drop, dual_clipped=terms.dual_clipped
    )


@register_policy_loss("kl_cov")
def kl_cov(inputs: PolicyInputs, config: PolicyConfig) -> PolicyTerms:
    """KL-Cov (verl 'kl_cov'): the unclipped -A r, plus ppo_kl_coef * |log r| on the top tokens.

    No clip at all: the max(1, int(kl_cov_ratio * valid tokens)) valid tokens of the call with
    the largest covariance (A - mean A)(log pi - mean log pi) get the penalty
    ppo_kl_coef * |log(pi / pi_old)| added (ties broken by position). Penalised tokens count
    as clipped.
    """
    c = config.log_ratio_clamp
    valid = inputs.valid
    d = (inputs.logprobs - inputs.old_logprobs).clamp(-c, c)
    ratio = torch.exp(d)
    loss = -inputs.advantages * ratio
    n_valid = int(valid.sum())
    top = torch.zeros_like(valid).flatten()
    if n_valid:
        k = max(1, int(n_valid * config.kl_cov_ratio))
        cov = torch.where(valid, _covariance(inputs), -math.inf).flatten()
        top[torch.sort(cov, descending=True, stable=True).indices[:k]] = True
    top = top.view_as(valid) & valid
    loss = torch.where(top, loss + config.ppo_kl_coef * d.abs(), loss)
    per_token = torch.where(valid, loss, 0.0)
    return PolicyTerms(
        per_token=per_token, ratio=ratio.detach(), clipped=top, dual_clipped=torch.zeros_like(top)
    )
