"""The GRPO maths as pure functions on tensors: no config objects, no models, no state.

Shape letters: B sequences (completions), G group size, T completion tokens, V vocabulary.

    log-probs   logp_BT = logits[b, t, ids[b, t]] - logsumexp(logits[b, t])       (always <= 0)
    advantages  A_i = (r_i - mean(r_group)) / (std(r_group) + eps)
    ratio       rho_BT = exp(logp - old_logp)                                     (1 on the first pass)
    surrogate   -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + beta * KL_k3
    aggregation one of LOSS_NORMALISERS (how token losses are summed and divided)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ADVANTAGE_EPS = 1e-4


def selective_log_softmax(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[ids] per position, one row at a time so (B, T, V) float32 is never copied."""
    rows = []
    for logits_TV, ids_T in zip(logits_BTV, ids_BT):
        logits_TV = logits_TV.float()
        picked_T = logits_TV.gather(-1, ids_T.unsqueeze(-1)).squeeze(-1)
        rows.append(picked_T - torch.logsumexp(logits_TV, dim=-1))
    return torch.stack(rows)


def token_entropy(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position, one row at a time. (B, T)"""
    rows = []
    for logits_TV in logits_BTV:
        logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
        rows.append(-(logp_TV.exp() * logp_TV).sum(-1))
    return torch.stack(rows)


def group_advantages(rewards_B: torch.Tensor, group_size: int, scale: str = "group",
                     eps: float = ADVANTAGE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages and a mask of groups whose rewards were all equal.

    Completions of one prompt are contiguous: rows [g*G, (g+1)*G) form group g.
    ``scale``: "group" divides by the group's std, "batch" by the std of all rewards, "none" not
    at all (Dr. GRPO). A constant group always gets zero advantages.

        >>> adv, zero_std = group_advantages(torch.tensor([0., 1., 2., 2.]), group_size=2)
        >>> adv.round(decimals=3).tolist(), zero_std.tolist()
        ([-0.707, 0.707, 0.0, 0.0], [False, True])
    """
    rewards_NG = rewards_B.view(-1, group_size)
    mean_N1 = rewards_NG.mean(dim=1, keepdim=True)
    std_N1 = rewards_NG.std(dim=1, keepdim=True)
    centred_NG = rewards_NG - mean_N1
    if scale == "group":
        advantages_NG = centred_NG / (std_N1 + eps)
    elif scale == "batch":
        advantages_NG = centred_NG / (rewards_B.std() + eps)
    elif scale == "none":
        advantages_NG = centred_NG
    else:
        raise ValueError(f"scale_rewards={scale!r} is not one of group, batch, none")
    zero_std_N = std_N1.squeeze(1) == 0
    return advantages_NG.reshape(-1), zero_std_N


def kl_k3(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1 with d = ref - logp; >= 0."""
    delta_BT = ref_logp_BT - logp_BT
    return torch.exp(delta_BT) - delta_BT - 1


@dataclass(frozen=True)
class BatchCounts:
    """Sizes of the whole optimisation batch a micro-batch belongs to (for exact accumulation)."""

    sequences: int  # completions in the optimizer step
    tokens: int  # completion tokens (mask sum) in the optimizer step
    micro_batches: int  # micro-batches accumulated into the optimizer step
    max_completion_length: int


# How a (B, T) tensor of token losses becomes this micro-batch's share of the step's loss.
# Each returns sum / normaliser so that summing the micro-batches of a step gives the step's loss.
LOSS_NORMALISERS: dict[str, Callable[[torch.Tensor, torch.Tensor, BatchCounts], torch.Tensor]] = {
    # DeepSeekMath: mean over each sequence's tokens, then mean over sequences.
    "grpo": lambda loss_BT, mask_BT, n: ((loss_BT * mask_BT).sum(1) / mask_BT.sum(1).clamp(min=1)).sum() / n.sequences,
    # Token mean within the micro-batch, then mean over micro-batches.
    "bnpo": lambda loss_BT, mask_BT, n: (loss_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1) / n.micro_batches,
    # Dr. GRPO: a constant normaliser, so long and short completions weigh the same per token.
    "dr_grpo": lambda loss_BT, mask_BT, n: (loss_BT * mask_BT).sum() / (n.sequences * n.max_completion_length),
    # DAPO: token mean over the whole generation batch.
    "dapo": lambda loss_BT, mask_BT, n: (loss_BT * mask_BT).sum() / max(n.tokens, 1),
}


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    counts: BatchCounts,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    ref_logp_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss with an optional k3 KL penalty; returns (loss, detached stats).

    ``mask_BT`` is 1 on completion tokens that are trained (EOS included) and 0 on padding.
    The stats are sums over masked tokens (clipped tokens, KL, entropy when given) plus the token
    count, so the stats of micro-batches add up exactly.
    """
    mask_BT = mask_BT.to(logp_BT.dtype)
    advantages_B1 = advantages_B.unsqueeze(1)
    ratio_BT = torch.exp(logp_BT - old_logp_BT)
    clipped_BT = torch.clamp(ratio_BT, 1 - epsilon_low, 1 + epsilon_high)
    surrogate_BT = torch.min(ratio_BT * advantages_B1, clipped_BT * advantages_B1)
    loss_BT = -surrogate_BT
    stats = {}
    if beta > 0:
        if ref_logp_BT is None:
            raise ValueError("beta > 0 needs ref_logp_BT")
        kl_BT = kl_k3(logp_BT, ref_logp_BT)
        loss_BT = loss_BT + beta * kl_BT
        stats["kl_sum"] = (kl_BT * mask_BT).sum().detach()
    loss = LOSS_NORMALISERS[loss_type](loss_BT, mask_BT, counts)
    with torch.no_grad():
        low_BT = (ratio_BT < 1 - epsilon_low) & (advantages_B1 < 0)
        high_BT = (ratio_BT > 1 + epsilon_high) & (advantages_B1 > 0)
        stats["clip_low_sum"] = (low_BT * mask_BT).sum()
        stats["clip_high_sum"] = (high_BT * mask_BT).sum()
        stats["tokens"] = mask_BT.sum()
        if entropy_BT is not None:
            stats["entropy_sum"] = (entropy_BT * mask_BT).sum()
    return loss, stats


def completion_mask(completion_ids_BT: torch.Tensor, eos_ids: list[int], lengths_B: torch.Tensor | None = None) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after it (padding). (B, T) long.

    ``lengths_B`` (optional) caps each row at its generated length, for rows that never hit EOS.
    """
    B, T = completion_ids_BT.shape
    is_eos_BT = torch.isin(completion_ids_BT, torch.tensor(eos_ids, device=completion_ids_BT.device))
    first_eos_B = torch.where(is_eos_BT.any(1), is_eos_BT.int().argmax(1), torch.full((B,), T, device=is_eos_BT.device))
    end_B = torch.minimum(first_eos_B + 1, torch.full_like(first_eos_B, T))
    if lengths_B is not None:
        end_B = torch.minimum(end_B, lengths_B)
    positions_BT = torch.arange(T, device=completion_ids_BT.device).expand(B, T)
    return (positions_BT < end_B.unsqueeze(1)).long()
