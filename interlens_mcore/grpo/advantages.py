"""Group-relative (GRPO) advantages: each sample is compared with the other samples of its prompt."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from interlens_mcore.types import Trajectory


def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    groups: torch.Tensor | Sequence[int],
    *,
    scale_by_std: bool = True,
    leave_one_out: bool = False,
    drop_zero_variance: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages [N] and a keep mask [N] from rewards [N] and group ids [N].

    A = r - baseline, where the baseline is the group mean, or with `leave_one_out` the mean of
    the *other* samples of the group (RLOO), which equals n / (n - 1) * (r - mean).
    With `scale_by_std`, A is divided by (std + eps), std being the unbiased standard deviation
    of the group's rewards (0 for a group of one). `keep` is False for the samples of groups
    whose rewards are all equal when `drop_zero_variance` (they carry no learning signal, and
    keeping them only dilutes the token mean); their advantage is 0 either way.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()  # [N] float64: exact group sums
    g = torch.as_tensor(groups).flatten()  # [N]
    if r.numel() == 0:
        raise ValueError("rewards must hold at least one reward, got an empty sequence")
    if g.shape != r.shape:
        raise ValueError(f"groups must have one id per reward ({r.numel()}), got {g.numel()}")
    if not torch.isfinite(r).all():
        raise ValueError(f"rewards must be finite, got {r[~torch.isfinite(r)][0].item()!r}")
    if g.is_floating_point():
        raise ValueError(f"groups must be integer ids, got dtype {g.dtype}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")

    _, index = torch.unique(g, return_inverse=True)  # [N] dense group index
    k = int(index.max()) + 1
    count = torch.zeros(k, dtype=torch.float64).index_add_(0, index, torch.ones_like(r))  # [K]
    total = torch.zeros(k, dtype=torch.float64).index_add_(0, index, r)  # [K]
    n = count[index]  # [N]
    mean = (total / count)[index]  # [N]
    centred = r - mean
    if leave_one_out:
        if bool((n < 2).any()):
            raise ValueError("groups: leave_one_out needs every group to hold >= 2 samples")
        centred = centred * n / (n - 1)
    sq = torch.zeros(k, dtype=torch.float64).index_add_(0, index, (r - mean) ** 2)  # [K]
    # Unbiased (n - 1) as in the GRPO paper's std; a group of one has no spread at all.
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))[index]
    hi = torch.full((k,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, index, r, "amax")
    lo = torch.full((k,), torch.inf, dtype=torch.float64).scatter_reduce_(0, index, r, "amin")
    varied = (hi > lo)[index]  # [N]; exact, unlike std > 0 after rounding
    adv = centred / (std + eps) if scale_by_std else centred
    # A constant group centres to 0 only up to rounding, which / eps would blow up: make it exact.
    adv = torch.where(varied, adv, torch.zeros_like(adv))
    keep = varied | (not drop_zero_variance)
    return adv.float(), keep


def trajectory_advantages(trajectories: Sequence[Trajectory], **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_advantages` on each trajectory's `reward` and `group`; every reward must be set."""
    rewards: list[float] = []
    for i, t in enumerate(trajectories):
        if t.reward is None:
            raise ValueError(f"trajectories[{i}].reward is None; score every trajectory first")
        rewards.append(float(t.reward))
    return group_advantages(rewards, [t.group for t in trajectories], **kwargs)
