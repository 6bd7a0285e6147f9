"""The GRPO family of losses, as pure tensor math.

- `config`: `LossConfig`, one field per command-line flag;
- `objective`: `grpo_loss` / `batch_loss` and the metric sums they return;
- `policy`: the policy surrogates ('vanilla', 'gspo', 'cispo') and `register_policy_loss`;
- `mask`: which tokens count, and the denominators; `is_weights`: rollout importance sampling;
  `kl`: KL estimators; `aggregation`: token / sequence reductions; `diagnostics`: off-policy
  figures.
"""
