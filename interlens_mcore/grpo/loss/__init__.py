"""The GRPO family of losses, as pure tensor math.

- `config`: `LossConfig`, one field per command-line flag;
- `objective`: `grpo_loss` / `batch_loss`, in named steps;
- `metrics`: the metric keys, the one reduction rule (by key suffix), `finalize_metrics`;
- `policy`: the policy surrogates ('vanilla', 'gspo', 'cispo') and `register_policy_loss`;
- `mask`: which tokens count, and the denominators; `is_weights`: rollout importance sampling;
  `kl`: KL estimators; `aggregation`: token / sequence reductions; `diagnostics`: off-policy
  figures.
"""
