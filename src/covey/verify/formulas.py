"""The quantities covey verify checks the step against, written out here from the papers and the
SPEC (docs/algorithms.md), independently of the code under test."""

from __future__ import annotations

import torch

from covey import core
from covey.train.batch import ScoredBatch


# Each reward scale of core.REWARD_SCALES written out: the (unbiased) std of the group, of the whole batch, or none.
SPREADS_WRITTEN_OUT = {"group": lambda rewards_NG: rewards_NG.std(1, keepdim=True),
                       "batch": lambda rewards_NG: rewards_NG.std(),
                       "none": lambda rewards_NG: torch.tensor(1.0, dtype=torch.float64)}

# Each KL estimator of core.KL_ESTIMATORS written out, from d = ref_logp - logp.
KL_WRITTEN_OUT = {"k1": lambda d: -d, "k2": lambda d: 0.5 * d ** 2, "k3": lambda d: torch.exp(d) - d - 1}


def advantages_written_out(rewards_NG: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    """GRPO's advantages of G completions per row, each group centred on its mean and divided by its
    spread (``SPREADS_WRITTEN_OUT``)."""
    eps = 0.0 if scale_rewards == "none" else core.ADVANTAGE_EPS
    return (rewards_NG - rewards_NG.mean(1, keepdim=True)) / (SPREADS_WRITTEN_OUT[scale_rewards](rewards_NG) + eps)


def formula_loss(batch: ScoredBatch, ref_logp_BT: torch.Tensor | None, logp_BT: torch.Tensor,
                 old_logp_BT: torch.Tensor, s: core.LossSettings, max_completion_length: int,
                 behaviour_logp_BT: torch.Tensor | None = None) -> torch.Tensor:
    """The loss written out from the papers (docs/algorithms.md), in float64: ``formula_token_loss``,
    aggregated as loss_type says (``AGGREGATIONS_WRITTEN_OUT``)."""
    mask = batch.samples.loss_mask_BT.double()
    T = mask.shape[1]
    behaviour = None if behaviour_logp_BT is None else behaviour_logp_BT[:, :T]
    per_token = formula_token_loss(s, logp_BT[:, :T], old_logp_BT[:, :T], batch.advantages_B, mask,
                                   None if ref_logp_BT is None else ref_logp_BT[:, :T], behaviour)
    return AGGREGATIONS_WRITTEN_OUT[s.loss_type](per_token, mask, max_completion_length)


def formula_token_loss(s: core.LossSettings, logp_BT: torch.Tensor, old_logp_BT: torch.Tensor,
                       advantages_B: torch.Tensor, mask_BT: torch.Tensor, ref_logp_BT: torch.Tensor | None,
                       behaviour_logp_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's loss in float64 (B, T): loss_type's objective (``OBJECTIVES_WRITTEN_OUT``) on the token
    ratio or GSPO's sequence ratio; the sequences the off-policy mask drops (drift from
    ``behaviour_logp_BT``, default the old log-probs) left out; plus beta times the KL estimator (times
    the ratio with use_bias_correction_kl)."""
    if s.loss_type not in OBJECTIVES_WRITTEN_OUT or s.loss_type not in AGGREGATIONS_WRITTEN_OUT:
        raise ValueError(f"loss_type {s.loss_type!r} has no formula written out in covey.verify.formulas")
    mask = mask_BT.double()
    adv = advantages_B.double()[:, None]
    logp, old = logp_BT.double(), old_logp_BT.double()
    w = formula_ratio(logp, old, mask, s.importance_sampling_level)
    per_token = OBJECTIVES_WRITTEN_OUT[s.loss_type](s, w, logp, old, adv, mask)
    if s.off_policy_mask_threshold is not None:  # DeepSeek-V3.2 eq. 9
        behaviour = old if behaviour_logp_BT is None else behaviour_logp_BT.double()
        drift = ((behaviour - logp) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        per_token = per_token * ~((adv < 0) & (drift > s.off_policy_mask_threshold))
    if s.beta > 0:
        kl = KL_WRITTEN_OUT[s.kl_estimator](ref_logp_BT.double() - logp)
        per_token = per_token + s.beta * (kl * w if s.use_bias_correction_kl else kl)
    return per_token


def _clipped(s, w, logp, old, adv, mask):
    """PPO's clipped surrogate, with delta's cap on the unclipped ratio and dual-clip's floor for A < 0."""
    unclipped = w if s.delta is None else torch.clamp(w, max=s.delta)
    objective = torch.minimum(unclipped * adv, torch.clamp(w, 1 - s.epsilon_low, 1 + s.epsilon_high) * adv)
    if s.clip_ratio_c is not None:
        objective = torch.where(adv < 0, torch.maximum(objective, s.clip_ratio_c * adv), objective)
    return -objective


def _cispo(s, w, logp, old, adv, mask):
    """CISPO: the log-prob weighted by the ratio capped at epsilon_high."""
    return -torch.clamp(w, max=s.epsilon_high) * adv * logp


def _sapo(s, w, logp, old, adv, mask):
    """SAPO's soft gate f(w) = 4 / tau sigmoid(tau (w - 1)), tau by the advantage's sign."""
    tau = _where(adv > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
    return -4 / tau * torch.sigmoid(tau * (w - 1)) * adv


def _vespo(s, w, logp, old, adv, mask):
    """VESPO: the log-prob weighted by phi(W) = W^k e^(lambda (1 - W)), W the product of the token ratios."""
    W = torch.exp(((logp - old) * mask).sum(1, keepdim=True))
    k = _where(adv >= 0, s.vespo_k_pos, s.vespo_k_neg)
    lam = _where(adv >= 0, s.vespo_lambda_pos, s.vespo_lambda_neg)
    return -(W ** k * torch.exp(lam * (1 - W))) * adv * logp


def _sequence_mean(per_token, mask, max_completion_length):
    """1/B sum_i 1/|o_i| sum_t l_it."""
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / mask.shape[0]


def _token_mean(per_token, mask, max_completion_length):
    """sum_it l_it / sum_i |o_i|."""
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def _constant(per_token, mask, max_completion_length):
    """Dr. GRPO: sum_it l_it / (B * max_completion_length)."""
    return (per_token * mask).sum() / (mask.shape[0] * max_completion_length)


def _sequence_sum(per_token, mask, max_completion_length):
    """LUSPO (arXiv:2602.05261): 1/B sum_i sum_t l_it, each sequence's loss times its length."""
    return (per_token * mask).sum(1).sum() / mask.shape[0]


# Each loss type of the registry (core.LOSS_TYPES) written out again from its paper: its token objective,
# and how one batch's token losses make the loss (all of a step's completions in one micro-batch).
OBJECTIVES_WRITTEN_OUT = {"grpo": _clipped, "bnpo": _clipped, "dr_grpo": _clipped, "dapo": _clipped,
                          "cispo": _cispo, "sapo": _sapo, "vespo": _vespo, "luspo": _clipped}
AGGREGATIONS_WRITTEN_OUT = {"grpo": _sequence_mean, "bnpo": _token_mean, "dr_grpo": _constant, "dapo": _token_mean,
                            "cispo": _token_mean, "sapo": _sequence_mean, "vespo": _token_mean, "luspo": _sequence_sum}


def _where(condition: torch.Tensor, yes: float, no: float) -> torch.Tensor:
    """``yes`` where ``condition`` holds, else ``no``, in float64 (the settings' values exactly)."""
    return torch.where(condition, torch.tensor(yes, dtype=torch.float64), torch.tensor(no, dtype=torch.float64))


def formula_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Each token's importance ratio: its own, or (GSPO) its sequence's length-normalised one."""
    if level == "sequence":
        return torch.exp(((logp - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(logp)
    return torch.exp(logp - old)


def formula_correction(current: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, correction) -> torch.Tensor:
    """The engine/trainer weights pi_current / pi_sampling written out, per token (B, T) or per completion
    (B,), truncated to [clip_min, clip_max] or zero outside it (``correction``: a core.EngineCorrection)."""
    log_w = (current.double() - sampling.double()) * mask.double()
    w = torch.exp(log_w.sum(1) if correction.level == "sequence" else log_w)
    low = correction.clip_min if correction.clip_min is not None else 0.0
    if correction.action == "truncate":
        return w.clamp(low, correction.clip_max)
    return torch.where((w < low) | (w > correction.clip_max), torch.zeros_like(w), w)


def eos_mask(ids_BT: torch.Tensor, eos_ids: list[int], pad_id: int, finish_reasons: list[str],
             max_length: int) -> torch.Tensor:
    """1 up to and including the first EOS of each row; a row cut at the length limit: all of its
    max_length tokens (the pad token may be among them, sampled); a row ended by a stop string:
    everything before its trailing padding."""
    mask = torch.zeros_like(ids_BT)
    for row, (ids, reason) in enumerate(zip(ids_BT.tolist(), finish_reasons)):
        end = next((t + 1 for t, tok in enumerate(ids) if tok in eos_ids), None)
        if end is None and reason == "length":
            end = max_length
        elif end is None:
            end = len(ids)
            while end > 0 and ids[end - 1] == pad_id:
                end -= 1
        mask[row, :end] = 1
    return mask


def episode_layout(turns: list[tuple[list[int], list[int] | None]], max_length: int
                   ) -> tuple[list[int], list[int], int]:
    """From an episode's turns as the engine handed them over (the ids the model sampled, then what the
    environment appended, None where the episode ended there): (the ids they make, 1 where the model
    sampled each, the episode's length). Without a last turn that ended it, the budget did: the episode
    holds max_length tokens."""
    ids, sampled = [], []
    for turn, appended in turns:
        ids += turn
        sampled += [1] * len(turn)
        ids += appended or []
        sampled += [0] * len(appended or [])
    ended = bool(turns) and turns[-1][1] is None
    return ids, sampled, len(ids) if ended else max_length
