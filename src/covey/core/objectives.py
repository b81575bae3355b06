"""The policy objectives: the clipped surrogate (PPO/GRPO, with two-sided and dual clipping), CISPO's
weighted log-prob, SAPO's soft gate and VESPO's kernel-weighted log-prob; each gives token losses (B, T)
and its own statistics from the micro-batch's ``PolicyTerms``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from covey.core.settings import LossSettings


@dataclass(frozen=True)
class PolicyTerms:
    """What a policy objective is computed from, for one micro-batch."""

    ratio_BT: torch.Tensor  # importance weight of the policy term (the token's, or GSPO's sequence ratio)
    logp_BT: torch.Tensor  # the current policy's log-probs (with their gradient)
    token_log_ratio_BT: torch.Tensor  # logp - old_logp of each token, whatever the importance level
    advantages_B1: torch.Tensor
    mask_BT: torch.Tensor  # 1 on trained tokens
    engine_weights: torch.Tensor | None  # the engine/trainer correction, (B, T) or (B, 1) (None: none)


@dataclass(frozen=True)
class Objective:
    """A policy objective: its token losses (B, T) and statistics (sums, detached) from PolicyTerms
    and the settings; ``weighs_engine_ratio`` where it folds the engine/trainer correction into its own
    weight (else the token losses are multiplied by it)."""

    token_loss: Callable[[PolicyTerms, LossSettings], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    weighs_engine_ratio: bool = False
    reports: tuple[str, ...] = ()  # the metrics of its own statistics: "clip_ratio", "vespo_phi"



def _clipped_surrogate(t: PolicyTerms, s: LossSettings):
    """PPO/GRPO: -min(w * A, clip(w, 1 - eps_low, 1 + eps_high) * A), with optional caps."""
    ratio_BT, advantages_B1 = t.ratio_BT, t.advantages_B1
    clipped_BT = torch.clamp(ratio_BT, 1 - s.epsilon_low, 1 + s.epsilon_high)
    unclipped_BT = ratio_BT if s.delta is None else torch.clamp(ratio_BT, max=s.delta)
    loss_BT = -torch.min(unclipped_BT * advantages_B1, clipped_BT * advantages_B1)
    if s.clip_ratio_c is not None:
        dual_BT = -s.clip_ratio_c * advantages_B1.expand_as(loss_BT)
        loss_BT = torch.where(advantages_B1 < 0, torch.min(loss_BT, dual_BT), loss_BT)
    with torch.no_grad():
        low_BT = (ratio_BT < 1 - s.epsilon_low) & (advantages_B1 < 0)
        high_BT = (ratio_BT > 1 + s.epsilon_high) & (advantages_B1 > 0)
    return loss_BT, {"clip_low_sum": (low_BT * t.mask_BT).sum(), "clip_high_sum": (high_BT * t.mask_BT).sum()}


def _cispo(t: PolicyTerms, s: LossSettings):
    """CISPO: -sg[min(w, eps_max)] * A * logp; every token keeps a gradient. The cap eps_max is
    ``epsilon_high`` itself, as in TRL (MiniMax-M1 writes it 1 + eps_high^IS); it caps from above only."""
    weight_BT = torch.clamp(t.ratio_BT, max=s.epsilon_high).detach()
    with torch.no_grad():
        high_BT = (t.ratio_BT > s.epsilon_high) & (t.advantages_B1 > 0)
    return -weight_BT * t.advantages_B1 * t.logp_BT, {"clip_low_sum": t.mask_BT.new_zeros(()),
                                                      "clip_high_sum": (high_BT * t.mask_BT).sum()}


def _sapo(t: PolicyTerms, s: LossSettings):
    """SAPO (arXiv:2511.20347): the hard clip becomes a soft gate, -f(w) * A with
    f(w) = 4 / tau * sigmoid(tau (w - 1)), tau = sapo_temperature_pos where A > 0, else _neg. Its
    gradient is 4 sigmoid (1 - sigmoid) w A grad logp: the plain policy gradient at w = 1, fading
    smoothly (never cut off) as w leaves 1, faster for a larger tau."""
    tau_B1 = torch.full_like(t.advantages_B1, s.sapo_temperature_neg).masked_fill(t.advantages_B1 > 0,
                                                                                 s.sapo_temperature_pos)
    gate_BT = torch.sigmoid(tau_B1 * (t.ratio_BT - 1)) * 4 / tau_B1
    return -gate_BT * t.advantages_B1, {}


_LOG_1E8 = math.log(1e-8)


@torch.no_grad()
def vespo_weights(t: PolicyTerms, s: LossSettings) -> torch.Tensor:
    """VESPO's weight phi(W) = W^k e^(lambda (1 - W)) of each sequence (1 at W = 1), where
    W = prod_t pi / pi_old is the sequence's own importance weight (a product, no length
    normalisation), times the engine/trainer correction's token weights where they are given; k and
    lambda are the _pos ones where A >= 0. In log space, with TRL's (and the paper code's) guards:
    log-ratios clamped to [-20, 20] per token, log W to [log 1e-8, 20], lambda at least 1e-4, and a
    non-finite phi taken as 0. (B, 1)"""
    log_w_B1 = (t.token_log_ratio_BT.clamp(-20.0, 20.0) * t.mask_BT).sum(1, keepdim=True)
    if t.engine_weights is not None:  # W = pi / pi_old * pi_old / pi_engine, token by token
        if t.engine_weights.shape != t.mask_BT.shape:
            raise ValueError("vespo folds the engine/trainer correction into W token by token: it needs token-level "
                             f"weights {tuple(t.mask_BT.shape)}, got {tuple(t.engine_weights.shape)}")
        log_w_B1 = log_w_B1 + (t.engine_weights.log().clamp(_LOG_1E8, 20.0) * t.mask_BT).sum(1, keepdim=True)
    log_w_B1 = log_w_B1.clamp(_LOG_1E8, 20.0)
    positive_B1 = t.advantages_B1 >= 0
    k_B1 = torch.full_like(log_w_B1, s.vespo_k_neg).masked_fill(positive_B1, s.vespo_k_pos)
    lam_B1 = torch.full_like(log_w_B1, s.vespo_lambda_neg).masked_fill(positive_B1, s.vespo_lambda_pos).clamp(min=1e-4)
    return torch.exp(lam_B1 + k_B1 * log_w_B1 - lam_B1 * log_w_B1.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _vespo(t: PolicyTerms, s: LossSettings):
    """VESPO (arXiv:2602.10693): -sg[phi(W)] * A * logp, a REINFORCE gradient reweighted per sequence
    by a smooth kernel of its importance weight instead of a clip (see ``vespo_weights``)."""
    phi_B1 = vespo_weights(t, s)
    return -phi_B1 * t.advantages_B1 * t.logp_BT, {"vespo_phi_sum": phi_B1.sum(),
                                                   "vespo_sequences": torch.tensor(float(len(phi_B1)))}


POLICY_OBJECTIVES = {
    "clipped": Objective(_clipped_surrogate, reports=("clip_ratio",)),
    "cispo": Objective(_cispo, reports=("clip_ratio",)),
    "sapo": Objective(_sapo),
    "vespo": Objective(_vespo, weighs_engine_ratio=True, reports=("vespo_phi",)),
}
