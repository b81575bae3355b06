"""Advantages: each completion's reward relative to its group's, scaled by the group's std, the
batch's or nothing (Dr. GRPO); several reward functions weighed and summed before or after.

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)                    REWARD_SCALES, REWARD_AGGREGATIONS
"""

from __future__ import annotations

import math
from typing import Callable

import torch

ADVANTAGE_EPS = 1e-4


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased std over the non-NaN entries (NaN where fewer than two)."""
    valid = ~x.isnan()
    count = valid.sum(dim=dim, keepdim=True) if dim is not None else valid.sum()
    mean = x.nanmean(dim=dim, keepdim=True) if dim is not None else x.nanmean()
    squares = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x))
    total = squares.sum(dim=dim, keepdim=True) if dim is not None else squares.sum()
    std = torch.sqrt(total / (count - 1).clamp(min=1)).masked_fill(count < 2, math.nan)
    return std if keepdim or dim is None else std.squeeze(dim)


# The denominator of the advantage: the group's std, the whole batch's std, or none (Dr. GRPO).
REWARD_SCALES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "group": lambda rewards_NG: nanstd(rewards_NG, dim=1, keepdim=True),
    "batch": lambda rewards_NG: nanstd(rewards_NG).expand(rewards_NG.shape[0], 1),
    "none": lambda rewards_NG: torch.ones(rewards_NG.shape[0], 1, dtype=rewards_NG.dtype),
}


def group_advantages(rewards_B: torch.Tensor, group_size: int, scale: str = "group",
                     eps: float = ADVANTAGE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages and a mask of groups whose rewards were all equal.

    Completions of one prompt are contiguous: rows [g*G, (g+1)*G) form group g. A NaN reward
    (no reward function applied) is left out of its group's mean and std and gets advantage 0.
    A constant group (its rewards all equal, or fewer than two of them) gets advantages of exactly
    0: its mean is computed in floating point, so centring alone could leave a rounding residue
    that the eps-sized denominator would blow up.

        >>> adv, zero_std = group_advantages(torch.tensor([0., 1., 2., 2.]), group_size=2)
        >>> adv.round(decimals=3).tolist(), zero_std.tolist()
        ([-0.707, 0.707, 0.0, 0.0], [False, True])
    """
    if scale not in REWARD_SCALES:
        raise ValueError(f"scale_rewards={scale!r} is not one of {', '.join(REWARD_SCALES)}")
    rewards_NG = rewards_B.view(-1, group_size)
    centred_NG = rewards_NG - rewards_NG.nanmean(dim=1, keepdim=True)
    denominator_N1 = REWARD_SCALES[scale](rewards_NG)
    if scale != "none":
        denominator_N1 = denominator_N1.nan_to_num(0.0) + eps
    advantages_NG = (centred_NG / denominator_N1).nan_to_num(0.0)
    # compared exactly, not through the std: equal rewards of a group of 6 can give a std of 1e-17
    highest_N = rewards_NG.nan_to_num(-math.inf).amax(dim=1)
    lowest_N = rewards_NG.nan_to_num(math.inf).amin(dim=1)
    constant_N = ~(highest_N > lowest_N)
    return advantages_NG.masked_fill(constant_N[:, None], 0.0).reshape(-1), constant_N


def _sum_then_normalize(rewards_BF, weights_F, group_size, scale, eps):
    return group_advantages(weighted_reward_sum(rewards_BF, weights_F), group_size, scale, eps)


def _normalize_then_sum(rewards_BF, weights_F, group_size, scale, eps):
    """Normalise each reward within its group, sum with weights, then normalise over the batch,
    so one reward with a large range cannot drown the others."""
    per_func = [group_advantages(rewards_BF[:, f], group_size, "group", eps)[0].masked_fill(rewards_BF[:, f].isnan(), math.nan)
                for f in range(rewards_BF.shape[1])]
    summed_B = weighted_reward_sum(torch.stack(per_func, dim=1), weights_F)
    advantages_B = ((summed_B - summed_B.nanmean()) / (nanstd(summed_B).nan_to_num(0.0) + eps)).nan_to_num(0.0)
    _, zero_std_N = group_advantages(weighted_reward_sum(rewards_BF, weights_F), group_size, "group", eps)
    return advantages_B, zero_std_N


# How several reward functions become one advantage per completion.
REWARD_AGGREGATIONS = {"sum_then_normalize": _sum_then_normalize, "normalize_then_sum": _normalize_then_sum}


def weighted_reward_sum(rewards_BF: torch.Tensor, weights_F: torch.Tensor) -> torch.Tensor:
    """Weighted sum over reward functions; None (NaN) entries are skipped; NaN if all are None. (B,)"""
    total_B = (rewards_BF * weights_F.to(rewards_BF.dtype)).nansum(dim=1)
    return total_B.masked_fill(rewards_BF.isnan().all(dim=1), math.nan)


def advantages_from_rewards(rewards_BF: torch.Tensor, weights_F: torch.Tensor, group_size: int,
                            scale: str = "group", aggregation: str = "sum_then_normalize",
                            eps: float = ADVANTAGE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_B, zero_std_N) from the per-function reward table (NaN = None)."""
    return REWARD_AGGREGATIONS[aggregation](rewards_BF, weights_F, group_size, scale, eps)
