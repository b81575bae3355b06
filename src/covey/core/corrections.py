"""What narrows or reweighs the trained tokens: the top-entropy tokens (80/20), the engine/trainer
importance weights, and DeepSeek-V3.2's off-policy sequence mask."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def high_entropy_mask(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """1 on the top ``top_quantile`` fraction of (masked) tokens by entropy, 0 elsewhere (80/20 rule)."""
    values = entropy_BT[mask_BT.bool()].float()
    if values.numel() == 0:
        return torch.zeros_like(mask_BT)
    threshold = torch.quantile(values, 1 - top_quantile)
    return ((entropy_BT >= threshold) & mask_BT.bool()).to(mask_BT.dtype)


# The ways the engine/trainer importance weights are applied (the config's vllm_importance_sampling_mode):
# per token or per completion, truncated to the clip range or zeroed outside it.
ENGINE_CORRECTION_LEVELS = ("token", "sequence")
ENGINE_CORRECTION_ACTIONS = ("truncate", "mask")
ENGINE_CORRECTION_MODES = tuple(f"{level}_{action}" for level in ENGINE_CORRECTION_LEVELS
                                for action in ENGINE_CORRECTION_ACTIONS)


@dataclass(frozen=True)
class EngineCorrection:
    """How the engine/trainer importance weights are applied (the config's vllm_importance_sampling_*)."""

    level: str = "sequence"  # "token": a weight per token; "sequence": one per completion (the product of its tokens')
    action: str = "mask"  # "truncate": clamp to [clip_min, clip_max]; "mask": 0 outside it
    clip_max: float = 3.0
    clip_min: float | None = None

    @classmethod
    def from_mode(cls, mode: str, clip_max: float, clip_min: float | None = None) -> "EngineCorrection":
        """From a mode of ``ENGINE_CORRECTION_MODES`` such as ``"token_truncate"`` (level, then action)."""
        if mode not in ENGINE_CORRECTION_MODES:
            raise ValueError(f"engine correction mode {mode!r} is not one of {', '.join(ENGINE_CORRECTION_MODES)}")
        level, action = mode.split("_")
        return cls(level, action, clip_max, clip_min)


def engine_importance_weights(trainer_logp_BT: torch.Tensor, sampling_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                              correction: EngineCorrection) -> torch.Tensor:
    """Correction for an engine whose sampling distribution differs from the trainer's forward
    (bf16 kernels, vLLM): w = pi_trainer / pi_engine per token or per sequence, then truncated to
    [clip_min, clip_max] or zeroed outside it. (B, T) or (B, 1)."""
    log_w_BT = ((trainer_logp_BT - sampling_logp_BT) * mask_BT).nan_to_num(0.0)
    log_w = log_w_BT.sum(1, keepdim=True) if correction.level == "sequence" else log_w_BT
    w = torch.exp(log_w)
    low = -math.inf if correction.clip_min is None else correction.clip_min
    if correction.action == "truncate":
        return torch.clamp(w, min=correction.clip_min, max=correction.clip_max)
    return w.masked_fill((w < low) | (w > correction.clip_max), 0.0)


def off_policy_mask(logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor, advantages_B1: torch.Tensor,
                    mask_BT: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556, eq. 9): 0 for a sequence with a
    negative advantage whose mean log-ratio of the behaviour policy (the one that sampled) to the
    current one, 1/|o| sum_t log(pi_behaviour / pi), exceeds ``threshold``; 1 for every other. A token
    the behaviour policy could not score (NaN) counts as no drift. (B, 1), no gradient."""
    drift_BT = ((behaviour_logp_BT - logp_BT.detach()) * mask_BT).nan_to_num(0.0)
    mean_drift_B1 = drift_BT.sum(1, keepdim=True) / mask_BT.sum(1, keepdim=True).clamp(min=1)
    return ((advantages_B1 >= 0) | (mean_drift_B1 <= threshold)).to(mask_BT.dtype)
