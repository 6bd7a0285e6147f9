"""`LossConfig`: the knobs of the GRPO loss, one field per command-line flag.

The command line is generated from these fields (`transformers.HfArgumentParser`): each field
carries its one-line help in its metadata, modes are `Literal` types (the parser's choices),
and the defaults are the command line's. Validation names the field that is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from interlens_mcore.grpo.loss.aggregation import AGGREGATIONS, Aggregation
from interlens_mcore.grpo.loss.is_weights import (
    IS_MODES,
    REJECTIONS,
    SEQUENCE_WEIGHTS,
    IsMode,
    Rejection,
    SequenceWeight,
)
from interlens_mcore.grpo.loss.kl import KL_ESTIMATORS, KLEstimator
from interlens_mcore.grpo.loss.policy import POLICY_LOSSES


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Knobs of `grpo_loss`; the command line is generated from these fields."""

    epsilon: float = field(default=0.2, metadata={"help": "ratio clipped to [1 - epsilon, 1 + epsilon_high]"})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "upper clip range (clip-higher, DAPO); None: epsilon"}
    )
    dual_clip: float | None = field(
        default=None, metadata={"help": "for A < 0, cap the loss at -A * dual_clip (> 1); None: off"}
    )
    policy_loss: str = field(
        default="vanilla",
        metadata={
            "help": "surrogate: vanilla (PPO clip), gspo (sequence ratio), cispo, cispo_seq, sapo, geo_mean "
            "(GMPO), clip_cov, kl_cov, or a registered one"
        },
    )
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "sapo: gate temperature where A > 0 (verl tau_pos)"}
    )
    sapo_temperature_neg: float = field(
        default=1.05, metadata={"help": "sapo: gate temperature where A <= 0 (verl tau_neg)"}
    )
    clip_cov_ratio: float = field(
        default=0.0002, metadata={"help": "clip_cov: fraction of the valid tokens whose gradient is dropped"}
    )
    clip_cov_lb: float = field(
        default=1.0, metadata={"help": "clip_cov: lower bound of the covariance of a droppable token"}
    )
    clip_cov_ub: float = field(
        default=5.0, metadata={"help": "clip_cov: upper bound of the covariance of a droppable token"}
    )
    kl_cov_ratio: float = field(
        default=0.0002, metadata={"help": "kl_cov: fraction of the valid tokens given the |log r| penalty"}
    )
    ppo_kl_coef: float = field(default=1.0, metadata={"help": "kl_cov: coefficient of the |log r| penalty"})
    entropy_coeff: float = field(
        default=0.0,
        metadata={"help": "entropy bonus: loss -= entropy_coeff * policy entropy, aggregated like the loss"},
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "policy loss only on the loss tokens in the top fraction of the step's entropy "
            "(over every DP rank); 1: all"
        },
    )
    beta: float = field(
        default=0.1, metadata={"help": "coefficient of KL(train || reference); 0: no reference model"}
    )
    kl_estimator: KLEstimator = field(
        default="k3", metadata={"help": "KL estimator; k1+ / k3+: k1 / k3 value with the k2 gradient"}
    )
    kl_clamp: float | None = field(
        default=None, metadata={"help": "clamp each token's KL estimate to [-kl_clamp, kl_clamp]; None: off"}
    )
    kl_is_weighted: bool = field(
        default=False, metadata={"help": "multiply the KL term by the rollout IS weights too"}
    )
    aggregation: Aggregation = field(
        default="token-mean", metadata={"help": "how per-token losses become the loss"}
    )
    loss_scale_factor: float | None = field(
        default=None,
        metadata={"help": "constant length L of seq-mean-token-sum-norm: sum / (sequences * L) (Dr. GRPO)"},
    )
    is_mode: IsMode | None = field(
        default="token_truncate", metadata={"help": "rollout IS correction; none: diagnostics only"}
    )
    is_threshold: float = field(
        default=2.0, metadata={"help": "IS weights truncated at it, or masked above it"}
    )
    is_threshold_low: float | None = field(
        default=None, metadata={"help": "lower bound of the IS weights (two-sided); None: none"}
    )
    is_sequence_weight: SequenceWeight = field(
        default="geometric",
        metadata={
            "help": "sequence / turn IS weight: geometric mean or product of the token ratios (the "
            "product sums the unclamped log-ratios, then bounds the sum by log_ratio_clamp)"
        },
    )
    is_batch_normalize: bool = field(
        default=False, metadata={"help": "rescale the IS weights to mean 1 over the batch"}
    )
    rejection: Rejection = field(
        default="none",
        metadata={
            "help": "reject off-policy tokens (out of loss and denominators): token / sequence ratio, KL"
        },
    )
    rejection_threshold: float | None = field(
        default=None,
        metadata={"help": "upper bound of the rejection rule (a ratio, or nats for sequence_k1 / _k3)"},
    )
    rejection_threshold_low: float | None = field(
        default=None,
        metadata={
            "help": "lower bound on pi_train / pi_rollout of the token / sequence rules (verl's 'lo_hi' "
            "bounds the inverse: ours (hi, lo) is its '1/hi_1/lo'); None: 1 / rejection_threshold"
        },
    )
    off_policy_sequence_mask_delta: float | None = field(
        default=None,
        metadata={
            "help": "drop negative-advantage tokens of samples whose mean log(pi_rollout / pi) > delta"
        },
    )
    bypass: bool = field(
        default=False,
        metadata={"help": "rollout logprobs as the old policy (the PPO ratio is then the IS ratio)"},
    )
    log_ratio_clamp: float = field(
        default=20.0, metadata={"help": "|log ratio| cap before exp: e^20 is large but finite in fp32"}
    )

    @property
    def correction(self) -> IsMode:
        """`is_mode` as the loss reads it: __post_init__ has turned a None into 'none'."""
        assert self.is_mode is not None, "__post_init__ replaces an is_mode of None by 'none'"
        return self.is_mode

    def __post_init__(self) -> None:
        if self.is_mode is None:  # the 'off' of Python callers; the command line says 'none'
            object.__setattr__(self, "is_mode", "none")
        self._check_clip()
        self._check_kl()
        self._check_is()
        self._check_rejection()

    def _check_clip(self) -> None:
        if not 0 < self.epsilon < 1:
            raise ValueError(f"LossConfig.epsilon must be in (0, 1), got {self.epsilon!r}")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ValueError(f"LossConfig.epsilon_high must be > 0 or None, got {self.epsilon_high!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"LossConfig.dual_clip must be > 1 or None, got {self.dual_clip!r}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"LossConfig.policy_loss must be one of {tuple(POLICY_LOSSES)} (register_policy_loss "
                f"adds one), got {self.policy_loss!r}"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"LossConfig.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}"
            )
        if self.loss_scale_factor is not None and not self.loss_scale_factor > 0:
            raise ValueError(
                f"LossConfig.loss_scale_factor must be > 0 or None, got {self.loss_scale_factor!r}"
            )
        if self.aggregation == "seq-mean-token-sum-norm" and self.loss_scale_factor is None:
            raise ValueError(
                "LossConfig.loss_scale_factor must be set for aggregation 'seq-mean-token-sum-norm' "
                "(a constant such as the maximum completion length), got None"
            )
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"LossConfig.log_ratio_clamp must be > 0, got {self.log_ratio_clamp!r}")
        self._check_named_losses()

    def _check_named_losses(self) -> None:
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LossConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"LossConfig.{name} must be in (0, 1], got {getattr(self, name)!r}")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(
                f"LossConfig.clip_cov_lb must be < clip_cov_ub={self.clip_cov_ub!r}, got {self.clip_cov_lb!r}"
            )
        if not self.ppo_kl_coef >= 0:
            raise ValueError(f"LossConfig.ppo_kl_coef must be >= 0, got {self.ppo_kl_coef!r}")
        if not (math.isfinite(self.entropy_coeff) and self.entropy_coeff >= 0):
            raise ValueError(
                f"LossConfig.entropy_coeff must be a finite number >= 0, got {self.entropy_coeff!r}"
            )
        if not 0 < self.top_entropy_quantile <= 1:
            raise ValueError(
                f"LossConfig.top_entropy_quantile must be in (0, 1], got {self.top_entropy_quantile!r}"
            )

    def _check_kl(self) -> None:
        if not self.beta >= 0:
            raise ValueError(f"LossConfig.beta must be >= 0, got {self.beta!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"LossConfig.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )
        if self.kl_clamp is not None and not self.kl_clamp > 0:
            raise ValueError(f"LossConfig.kl_clamp must be > 0 or None, got {self.kl_clamp!r}")

    def _check_is(self) -> None:
        if self.is_mode not in IS_MODES:
            raise ValueError(f"LossConfig.is_mode must be one of {IS_MODES} or None, got {self.is_mode!r}")
        if not self.is_threshold > 0:
            raise ValueError(f"LossConfig.is_threshold must be > 0, got {self.is_threshold!r}")
        low = self.is_threshold_low
        if low is not None and not 0 < low < self.is_threshold:
            raise ValueError(
                f"LossConfig.is_threshold_low must be in (0, is_threshold={self.is_threshold}) or None, "
                f"got {low!r}"
            )
        if self.is_sequence_weight not in SEQUENCE_WEIGHTS:
            raise ValueError(
                f"LossConfig.is_sequence_weight must be one of {SEQUENCE_WEIGHTS}, "
                f"got {self.is_sequence_weight!r}"
            )
        if self.is_batch_normalize and self.is_mode == "none":
            raise ValueError("LossConfig.is_batch_normalize must be False when is_mode is 'none', got True")
        if self.bypass and self.is_mode != "none":
            raise ValueError(
                f"LossConfig.is_mode must be 'none' when bypass=True, got {self.is_mode!r}: the rollout "
                "policy is then the old policy, so the clipped PPO ratio already is the IS correction"
            )

    def _check_rejection(self) -> None:
        if self.rejection not in REJECTIONS:
            raise ValueError(f"LossConfig.rejection must be one of {REJECTIONS}, got {self.rejection!r}")
        hi, low = self.rejection_threshold, self.rejection_threshold_low
        if self.rejection == "none":
            if hi is not None or low is not None:
                raise ValueError(
                    "LossConfig.rejection_threshold must be None when rejection is 'none', "
                    f"got rejection_threshold={hi!r}, rejection_threshold_low={low!r}"
                )
        elif hi is None or not hi > 0:
            raise ValueError(
                f"LossConfig.rejection_threshold must be > 0 for rejection {self.rejection!r}, got {hi!r}"
            )
        elif self.rejection in ("token", "sequence"):
            lo = 1 / hi if low is None else low
            if not 0 < lo < hi:
                raise ValueError(
                    f"LossConfig.rejection_threshold_low must be in (0, rejection_threshold={hi}) "
                    f"(None: 1 / rejection_threshold), got {low!r}"
                )
        elif low is not None:
            raise ValueError(
                f"LossConfig.rejection_threshold_low must be None for rejection {self.rejection!r} "
                f"(a one-sided KL bound), got {low!r}"
            )
        delta = self.off_policy_sequence_mask_delta
        if delta is not None and not delta >= 0:
            raise ValueError(f"LossConfig.off_policy_sequence_mask_delta must be >= 0 or None, got {delta!r}")

    @property
    def rejects(self) -> bool:
        """Whether a rule removes tokens (so the denominators need `loss_token_mask`)."""
        return self.rejection != "none" or self.off_policy_sequence_mask_delta is not None
