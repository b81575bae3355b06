"""The policy loss of one micro-batch: the importance ratio (token or GSPO's sequence level), the
objective, the off-policy mask, the KL term towards the reference, the aggregation of token losses
into the step's loss, and the entropy bonus; its typed, detached statistics (``LossStats``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from covey.core.corrections import high_entropy_mask, off_policy_mask
from covey.core.objectives import POLICY_OBJECTIVES, PolicyTerms
from covey.core.settings import BatchCounts, LossSettings


def _token_ratio(logp_BT, old_logp_BT, mask_BT):
    log_ratio_BT = logp_BT - old_logp_BT
    return log_ratio_BT, log_ratio_BT


def _gspo_token_ratio(logp_BT, old_logp_BT, mask_BT):
    """GSPO-token: the value is the length-normalised sequence log-ratio log s_i, the gradient flows
    through each token's own log-prob: log s_it = sg[log s_i] + logp_t - sg[logp_t]. The KL term's
    bias correction weighs by s_i itself, its gradient spread over the sequence's tokens (as TRL)."""
    sequence_B1 = ((logp_BT - old_logp_BT) * mask_BT).sum(1, keepdim=True) / mask_BT.sum(1, keepdim=True).clamp(min=1)
    return sequence_B1.detach() + logp_BT - logp_BT.detach(), sequence_B1


# (log importance weight of the policy term, (B, T); log weight of the KL term's bias correction, (B, T) or (B, 1))
IMPORTANCE_LEVELS = {"token": _token_ratio, "sequence": _gspo_token_ratio}



@dataclass(frozen=True)
class LossStats:
    """What ``policy_loss`` measured on one micro-batch, detached: sums over its trained tokens (or its
    sequences) and their counts, so the micro-batches of a step add up. A statistic the run's variant
    does not produce stays 0; which ones a run reports is ``reported_metrics``'s choice."""

    policy_loss: float = 0.0  # the policy term alone, as this micro-batch's share of the step's loss
    tokens: float = 0.0  # the tokens of the loss mask
    entropy_sum: float = 0.0  # of the policy's token entropies, where they were computed
    kl_sum: float = 0.0  # of the KL estimate to the reference (beta > 0)
    clip_low_sum: float = 0.0  # tokens clipped below (negative advantage), clipping objectives
    clip_high_sum: float = 0.0  # tokens clipped above (positive advantage)
    vespo_phi_sum: float = 0.0  # VESPO's sequence weights
    vespo_sequences: float = 0.0
    off_policy_masked: float = 0.0  # sequences the off-policy mask dropped
    off_policy_sequences: float = 0.0
    entropy_bonus_sum: float = 0.0  # entropies of the tokens the entropy bonus trains
    entropy_bonus_tokens: float = 0.0
    aux_loss_sum: float = 0.0  # a mixture-of-experts router's load-balancing loss
    aux_loss_count: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# How a (B, T) tensor of token losses becomes this micro-batch's share of the step's loss.
# Each returns sum / normaliser so that summing the micro-batches of a step gives the step's loss.
LOSS_NORMALISERS: dict[str, Callable[[torch.Tensor, torch.Tensor, BatchCounts], torch.Tensor]] = {
    # DeepSeekMath: mean over each sequence's tokens, then mean over sequences.
    "sequence_mean": lambda loss_BT, mask_BT, n: ((loss_BT * mask_BT).sum(1) / mask_BT.sum(1).clamp(min=1)).sum() / n.sequences,
    # Token mean within the micro-batch, then mean over micro-batches.
    "micro_batch_token_mean": lambda loss_BT, mask_BT, n: (loss_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1) / n.micro_batches,
    # Dr. GRPO: a constant normaliser, so long and short completions weigh the same per token.
    "constant": lambda loss_BT, mask_BT, n: (loss_BT * mask_BT).sum() / (n.sequences * n.max_completion_length),
    # DAPO: token mean over the whole generation batch.
    "generation_token_mean": lambda loss_BT, mask_BT, n: (loss_BT * mask_BT).sum() / max(n.tokens, 1.0),
    # LUSPO: each sequence's loss times its length (the sum over its tokens), then mean over sequences.
    "sequence_sum": lambda loss_BT, mask_BT, n: (loss_BT * mask_BT).sum() / n.sequences,
}

class LossType(NamedTuple):
    """What one ``loss_type`` is: an objective of ``POLICY_OBJECTIVES`` and an aggregation of ``LOSS_NORMALISERS``."""

    objective: str
    aggregation: str


# The registry of loss types: the config's choices, covey verify's written-out formulas and its checks of
# TRL's loss all read their names from here; a new variant is one entry here plus its formula in each
# (tests/test_variants.py::test_every_loss_type_of_the_registry_is_known_everywhere walks it).
LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType("clipped", "sequence_mean"),
    "bnpo": LossType("clipped", "micro_batch_token_mean"),
    "dr_grpo": LossType("clipped", "constant"),
    "dapo": LossType("clipped", "generation_token_mean"),
    "cispo": LossType("cispo", "generation_token_mean"),
    "sapo": LossType("sapo", "sequence_mean"),  # the SAPO paper's per-sequence mean, as TRL
    "vespo": LossType("vespo", "generation_token_mean"),  # a token mean over the batch, as TRL (and the paper code's default)
    "luspo": LossType("clipped", "sequence_sum"),  # with importance_sampling_level: sequence, as the paper and TRL
}

# Estimators of KL(pi || pi_ref) per token from samples of pi; d = ref_logp - logp.
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": lambda logp, ref: logp - ref,  # unbiased, can be negative
    "k2": lambda logp, ref: 0.5 * (logp - ref) ** 2,  # biased, low variance, >= 0
    "k3": lambda logp, ref: torch.exp(ref - logp) - (ref - logp) - 1,  # unbiased, >= 0 (GRPO's choice)
}



def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    counts: BatchCounts,
    settings: LossSettings,
    ref_logp_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
    engine_weights: torch.Tensor | None = None,
    behaviour_logp_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    router_aux_loss: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The GRPO-family loss of one micro-batch; returns (loss, its statistics).

    ``mask_BT`` is 1 on completion tokens that are trained (EOS included) and 0 on padding.
    ``entropy_BT`` is needed for ``top_entropy_quantile`` < 1 and for the entropy bonus (then with
    its gradient), and reported when given; ``engine_weights`` ((B, T) or (B, 1)) correct for the
    engine (they multiply the policy term, or enter the objective's own weight); ``behaviour_logp_BT``,
    the log-probs of the policy that sampled, is needed for ``off_policy_mask_threshold``;
    ``entropy_coef`` is the entropy bonus's coefficient this step applies (``EntropyBonus.applied``);
    ``router_aux_loss``: a mixture-of-experts model's load-balancing loss on this micro-batch, added with
    ``router_aux_loss_coef`` (its mean over the micro-batches, whatever the loss_type).
    Stats are sums over masked tokens plus the token count, so micro-batches add up exactly.
    """
    s = settings
    objective_name, aggregation = LOSS_TYPES[s.loss_type]
    objective = POLICY_OBJECTIVES[objective_name]
    mask_BT = mask_BT.to(logp_BT.dtype)
    advantages_B1 = advantages_B.to(logp_BT.dtype).unsqueeze(1)
    log_ratio_BT, log_kl_weight = IMPORTANCE_LEVELS[s.importance_sampling_level](logp_BT, old_logp_BT, mask_BT)
    terms = PolicyTerms(torch.exp(log_ratio_BT), logp_BT, logp_BT - old_logp_BT, advantages_B1, mask_BT,
                        engine_weights if objective.weighs_engine_ratio else None)
    loss_BT, stats = objective.token_loss(terms, s)
    if s.off_policy_mask_threshold is not None:
        if behaviour_logp_BT is None:
            raise ValueError("off_policy_mask_threshold needs behaviour_logp_BT")
        kept_B1 = off_policy_mask(logp_BT, behaviour_logp_BT, advantages_B1, mask_BT, s.off_policy_mask_threshold)
        loss_BT = loss_BT * kept_B1
        stats["off_policy_masked"] = (1 - kept_B1).sum()
        stats["off_policy_sequences"] = torch.tensor(float(len(kept_B1)))
    train_mask_BT = mask_BT
    if s.top_entropy_quantile < 1.0:
        if entropy_BT is None:
            raise ValueError("top_entropy_quantile < 1 needs entropy_BT")
        train_mask_BT = high_entropy_mask(entropy_BT.detach(), mask_BT, s.top_entropy_quantile)
        loss_BT = loss_BT * train_mask_BT
    if engine_weights is not None and not objective.weighs_engine_ratio:
        loss_BT = loss_BT * engine_weights
    stats["policy_loss"] = LOSS_NORMALISERS[aggregation](loss_BT.detach(), mask_BT, counts)
    if s.beta > 0:
        if ref_logp_BT is None:
            raise ValueError("beta > 0 needs ref_logp_BT")
        kl_BT = KL_ESTIMATORS[s.kl_estimator](logp_BT, ref_logp_BT)
        stats["kl_sum"] = (kl_BT * mask_BT).sum().detach()
        loss_BT = loss_BT + s.beta * (kl_BT * torch.exp(log_kl_weight) if s.use_bias_correction_kl else kl_BT)
    loss = LOSS_NORMALISERS[aggregation](loss_BT, mask_BT, counts)
    if s.entropy_bonus.enabled:
        if entropy_BT is None:
            raise ValueError("an entropy bonus needs entropy_BT")
        # the mean entropy of the tokens the policy term trains, per micro-batch: the same meaning for
        # every loss_type (the bonus is not put through the policy term's aggregation)
        loss = loss - entropy_coef * LOSS_NORMALISERS["micro_batch_token_mean"](entropy_BT, train_mask_BT, counts)
        stats["entropy_bonus_sum"] = (entropy_BT * train_mask_BT).sum().detach()
        stats["entropy_bonus_tokens"] = train_mask_BT.sum()
    if s.router_aux_loss_coef:
        if router_aux_loss is None:
            raise ValueError("router_aux_loss_coef needs router_aux_loss")
        loss = loss + s.router_aux_loss_coef * router_aux_loss / counts.micro_batches
        stats["aux_loss_sum"], stats["aux_loss_count"] = router_aux_loss.detach(), torch.tensor(1.0)
    with torch.no_grad():
        stats["tokens"] = mask_BT.sum()
        if entropy_BT is not None:
            stats["entropy_sum"] = (entropy_BT * mask_BT).sum()
    return loss, LossStats(**{name: float(value) for name, value in stats.items()})


def reported_metrics(settings: LossSettings) -> frozenset[str]:
    """The loss statistics a run reports as metrics, chosen once from its settings: "kl" (beta > 0), the
    objective's own ("clip_ratio", "vespo_phi"), "off_policy_mask", "aux_loss", "entropy_coef" (the
    entropy bonus)."""
    objective = POLICY_OBJECTIVES[LOSS_TYPES[settings.loss_type].objective]
    chosen = {"kl": settings.beta > 0, "off_policy_mask": settings.off_policy_mask_threshold is not None,
              "aux_loss": bool(settings.router_aux_loss_coef), "entropy_coef": settings.entropy_bonus.enabled}
    return frozenset(objective.reports) | {name for name, on in chosen.items() if on}
