"""The GRPO maths as pure functions on tensors: no config objects, no models, no state, nothing else
of covey imported.

Shape letters: B sequences (completions), G group size, N groups, F reward functions,
T completion tokens, V vocabulary.

    log-probs   logp_BT = logits[b, t, ids[b, t]] - logsumexp(logits[b, t])       (always <= 0)
    advantages  A_i = (r_i - mean(r_group)) / (std(r_group) + eps)                REWARD_SCALES
    ratio       w_BT = exp(logp - old_logp), or GSPO's sequence ratio            IMPORTANCE_LEVELS
    objective   clipped surrogate (PPO/GRPO), CISPO's weighted log-prob, SAPO's   POLICY_OBJECTIVES
                soft gate or VESPO's kernel-weighted log-prob
    KL          beta * k1 | k2 | k3 estimator towards the reference               KL_ESTIMATORS
    aggregation how token losses are summed and divided                         LOSS_NORMALISERS
    extras      the off-policy sequence mask; the entropy bonus                   off_policy_mask, EntropyBonus

Every variant is one entry of one of these tables; ``LOSS_TYPES`` names the (objective,
aggregation) pairs that the config's ``loss_type`` selects. The papers: GRPO (DeepSeekMath,
arXiv:2402.03300), Dr. GRPO (arXiv:2503.20783), DAPO (arXiv:2503.14476), GSPO (arXiv:2507.18071),
CISPO (MiniMax-M1, arXiv:2506.13585), SAPO (arXiv:2511.20347), VESPO (arXiv:2602.10693), dual-clip
PPO (arXiv:1912.09729), two-sided clipping (INTELLECT-2, arXiv:2505.07291), the off-policy mask
(DeepSeek-V3.2, arXiv:2512.02556), adaptive entropy control (Skywork-OR1, arXiv:2505.22312),
k1/k2/k3 (Schulman, "Approximating KL divergence", 2020).
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

ADVANTAGE_EPS = 1e-4

# ---- log-probs ----------------------------------------------------------------------------------

LOGPROB_CHUNK_TOKENS = 128
"""Rows of logits ``token_logprobs`` turns into float32 log-softmaxes at once (its working copies)."""

LOGPROB_CHUNK_BYTES = 128 * 2**20
"""The output head's budget in the log-prob pass (``covey.train.head``): the head runs on as many completion
tokens at once as have float32 logits within it (``logprob_chunk_tokens``: 682 tokens of a vocabulary of
49,152, 220 of Qwen's 151,936), so a micro-batch that fits runs in one chunk; in a pass with a gradient the
forward keeps the logits of the chunks that fit the same budget (the first) for the backward, which
computes only the others again. At the worst moment (the backward of the kept chunk) the pass holds one
chunk's logits and their gradient (twice the budget, in float32) and float32 working copies of a
sixteenth of the budget at a time: about 300 MB whatever the vocabulary and the length; beside them, per
token, its hidden state and two float32 results, and one float32 V x H accumulator of the head weight's
gradient where the weight trains. A larger budget makes fewer and larger matrix products and computes fewer logits
twice; a smaller one lowers the peak."""


def logprob_chunk_tokens(vocab: int, budget: int | None = None) -> int:
    """Completion tokens the output head runs on at once: those whose float32 logits fit ``budget`` bytes
    (``LOGPROB_CHUNK_BYTES``), at least one."""
    return max(1, (LOGPROB_CHUNK_BYTES if budget is None else budget) // (4 * vocab))


@dataclass(frozen=True)
class TokenDistribution:
    """What a completion token is sampled from, given the model's logits x: softmax(x / temperature) over
    the tokens that top_k, top_p and min_p keep, applied in that order (transformers' and the fast
    engine's; 0, 1.0 and 0 keep every token). The engines report the log-probs of this distribution, and
    the trainer computes its own of the same one, so the policy trained is the one that samples and the
    engine/trainer ratio carries no factor of the probability mass the truncation kept."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def truncates(self) -> bool:
        return bool(self.top_k) or self.top_p < 1.0 or bool(self.min_p)

    def logits(self, logits_NV: torch.Tensor, ids_N: torch.Tensor | None = None) -> torch.Tensor:
        """x / temperature in float32, -inf at the tokens the truncation drops, which it decides without a
        gradient; never at ``ids_N``, the tokens sampled (a token the engine kept stays on the support
        where rounding or a policy moved since sampling would drop it)."""
        scaled = _scaled(logits_NV, self.temperature)
        if not self.truncates:
            return scaled
        with torch.no_grad():
            removed = truncated_away(scaled, self.top_k, self.top_p, self.min_p)
            if ids_N is not None:
                removed.scatter_(-1, ids_N.unsqueeze(-1), False)
        return scaled.masked_fill(removed, -torch.inf)


def truncated_away(scaled: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The tokens top-k, then top-p (the most likely token always stays), then min-p remove from
    ``scaled``, the logits after the temperature: a bool mask (..., V)."""
    removed = torch.zeros_like(scaled, dtype=torch.bool)
    if top_k and top_k < scaled.shape[-1]:
        removed |= scaled < torch.topk(scaled, top_k, dim=-1).values[..., -1:]
    if top_p < 1.0:
        ascending, order = torch.sort(scaled.masked_fill(removed, -torch.inf), descending=False, dim=-1)
        drop_sorted = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop_sorted[..., -1] = False
        removed |= drop_sorted.scatter(-1, order, drop_sorted)
    if min_p:
        probs = scaled.masked_fill(removed, -torch.inf).softmax(-1)
        removed |= probs < min_p * probs.max(-1, keepdim=True).values
    return removed


def token_logprobs(logits_NV: torch.Tensor, ids_N: torch.Tensor, with_entropy: bool = False,
                   temperature: float | TokenDistribution = 1.0, chunk: int = LOGPROB_CHUNK_TOKENS,
                   entropy_grad: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(logits / temperature)[ids], its entropy or None) per position, in float32,
    ``chunk`` positions at a time so a float32 copy of all the logits is never held. Works on any
    leading shape (..., V). ``temperature``: a number, or the whole ``TokenDistribution`` sampled from
    (then over the tokens its truncation keeps). The entropy carries a gradient only with
    ``entropy_grad`` (an entropy bonus trains on it); else it is a plain value.
    """
    shape = ids_N.shape
    distribution = temperature if isinstance(temperature, TokenDistribution) else TokenDistribution(temperature)
    logp_N, entropy_N = _TokenLogprobs.apply(logits_NV.reshape(-1, logits_NV.shape[-1]), ids_N.reshape(-1),
                                             distribution, with_entropy or entropy_grad, chunk, entropy_grad)
    return logp_N.reshape(shape), entropy_N.reshape(shape) if with_entropy or entropy_grad else None


class _TokenLogprobs(torch.autograd.Function):
    """The log-softmax at the chosen ids, and optionally the entropy, with a hand-written backward:
    for z = x / temperature (-inf where a truncation drops a token: p_j = 0 there, and no gradient)
    and p = softmax(z),

        d logp_id / dz_j = onehot(id)_j - p_j        d H / dz_j = -p_j (log p_j + H)

    each divided by the temperature for the gradient in x. Autograd through logsumexp + gather would
    keep float32 copies of every chunk for the backward and make several passes over them; this keeps
    only the logits as given (and the entropy, one number a position) and recomputes the softmax chunk
    by chunk when the gradient is asked for."""

    @staticmethod
    def forward(ctx, logits_NV, ids_N, distribution, with_entropy, chunk, entropy_grad):
        logp_N = torch.empty(ids_N.shape, dtype=torch.float32, device=logits_NV.device)
        entropy_N = torch.empty(ids_N.shape if with_entropy else 0, dtype=torch.float32, device=logits_NV.device)
        for first in range(0, len(ids_N), chunk):
            rows = slice(first, first + chunk)
            log_softmax = distribution.logits(logits_NV[rows], ids_N[rows]).log_softmax(-1)
            logp_N[rows] = log_softmax.gather(-1, ids_N[rows, None]).squeeze(-1)
            if with_entropy:  # H = -sum p log p, clamped against rounding below 0 (0 log 0 = 0)
                log_p = _finite(log_softmax) if distribution.truncates else log_softmax
                entropy_N[rows] = (-(log_softmax.exp() * log_p).sum(-1)).clamp(min=0)
        if entropy_grad:
            ctx.save_for_backward(logits_NV, ids_N, entropy_N)
        else:
            ctx.save_for_backward(logits_NV, ids_N)
            ctx.mark_non_differentiable(entropy_N)
        ctx.distribution, ctx.chunk = distribution, chunk
        ctx.set_materialize_grads(False)  # an output the loss does not use has no gradient to add
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N, grad_entropy_N):
        logits_NV, ids_N, *entropy = ctx.saved_tensors
        grad_NV = torch.empty_like(logits_NV)
        for first in range(0, len(ids_N), ctx.chunk):
            rows = slice(first, first + ctx.chunk)
            scaled = ctx.distribution.logits(logits_NV[rows], ids_N[rows])
            if grad_entropy_N is None:  # log-probs only: one fused softmax
                chunk_grad = scaled.softmax(-1).mul_(-grad_logp_N[rows, None])
            else:  # -p_j (g_logp + g_H (log p_j + H)), then + g_logp at the id
                log_p = scaled.log_softmax(-1)
                p = log_p.exp()
                if ctx.distribution.truncates:
                    log_p.masked_fill_(p == 0, 0.0)  # 0 log 0 = 0 off the support
                chunk_grad = log_p.add_(entropy[0][rows, None]).mul_(grad_entropy_N[rows, None])
                if grad_logp_N is not None:
                    chunk_grad.add_(grad_logp_N[rows, None])
                chunk_grad.mul_(p).neg_()
            if grad_logp_N is not None:
                chunk_grad.scatter_add_(-1, ids_N[rows, None], grad_logp_N[rows, None])
            temperature = ctx.distribution.temperature
            grad_NV[rows] = chunk_grad / temperature if temperature != 1 else chunk_grad
        return grad_NV, None, None, None, None, None


def _finite(log_p: torch.Tensor) -> torch.Tensor:
    """Log-probs with the -inf of tokens off the support as 0 (their p is 0: 0 log 0 = 0)."""
    return log_p.masked_fill(log_p == -torch.inf, 0.0)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()  # the temperature is applied after the cast, not in the logits' own dtype
    return logits if temperature == 1 else logits / temperature


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
    return length_mask(end_B, T)


def length_mask(lengths_B: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T) long mask: 1 at the first ``lengths_B[b]`` positions of row b, 0 after."""
    positions_BT = torch.arange(T, device=lengths_B.device).expand(len(lengths_B), T)
    return (positions_BT < lengths_B.unsqueeze(1)).long()


# ---- advantages ---------------------------------------------------------------------------------


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


# ---- the policy loss ----------------------------------------------------------------------------


@dataclass(frozen=True)
class EntropyBonus:
    """The entropy bonus: the loss subtracts coef times the mean token entropy (over the tokens the
    policy term trains), whatever the loss_type's aggregation. Under adaptive control (Skywork-OR1,
    arXiv:2505.22312) the coefficient is run state that moves after every optimizer step, by
    ``moved``, and a step applies it only while the entropy last measured is at most the target."""

    coef: float = 0.0  # the coefficient, or under adaptive control the one the run starts from
    adaptive: bool = False
    target: float = 0.2  # nats per token
    delta: float = 0.005
    coef_min: float = 0.0
    coef_max: float = 1.0

    @property
    def enabled(self) -> bool:
        """Whether the loss carries the bonus (adaptive control may bring a coefficient of 0 back up)."""
        return self.coef != 0 or self.adaptive

    def applied(self, coef: float, last_entropy: float | None) -> float:
        """The coefficient a step applies, given the current one and the entropy the last step measured
        (None: none yet, so adaptive control applies nothing)."""
        if not self.adaptive:
            return coef
        return coef if last_entropy is not None and last_entropy <= self.target else 0.0

    def moved(self, coef: float, entropy: float) -> float:
        """Adaptive control after a step whose trained tokens had mean ``entropy``: delta up at or below
        the target, delta down above it (a NaN entropy too), kept within [coef_min, coef_max]."""
        if entropy <= self.target:
            return min(coef + self.delta, self.coef_max)
        return max(coef - self.delta, self.coef_min)


@dataclass(frozen=True)
class LossSettings:
    """The knobs of the policy loss (what the config's loss fields select)."""

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None  # two-sided clipping: cap on the unclipped ratio (INTELLECT-2)
    clip_ratio_c: float | None = None  # dual-clip: for A < 0 the objective never drops below c * A
    importance_sampling_level: str = "token"  # "sequence" = GSPO
    beta: float = 0.0
    kl_estimator: str = "k3"
    use_bias_correction_kl: bool = False  # multiply the KL term by the importance ratio
    top_entropy_quantile: float = 1.0  # train only on the top fraction of tokens by entropy
    sapo_temperature_pos: float = 1.0  # SAPO's gate temperature where A > 0
    sapo_temperature_neg: float = 1.05  # and where A <= 0
    vespo_k_pos: float = 2.0  # VESPO's kernel W^k e^(lambda (1 - W)) where A >= 0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0  # and where A < 0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2's delta (None: no off-policy mask)
    entropy_bonus: EntropyBonus = EntropyBonus()
    router_aux_loss_coef: float = 0.0  # mixture-of-experts models: weight of the router's load-balancing loss


@dataclass(frozen=True)
class BatchCounts:
    """Sizes of the optimisation batch a micro-batch belongs to, so micro-batches add up exactly."""

    sequences: int  # completions in the optimizer step
    tokens: float  # token normaliser of dapo / cispo (tokens of the generation batch per optimizer step)
    micro_batches: int  # micro-batches accumulated into the optimizer step
    max_completion_length: int


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

# loss_type -> (objective, aggregation)
LOSS_TYPES = {
    "grpo": ("clipped", "sequence_mean"),
    "bnpo": ("clipped", "micro_batch_token_mean"),
    "dr_grpo": ("clipped", "constant"),
    "dapo": ("clipped", "generation_token_mean"),
    "cispo": ("cispo", "generation_token_mean"),
    "sapo": ("sapo", "sequence_mean"),  # the SAPO paper's per-sequence mean, as TRL
    "vespo": ("vespo", "generation_token_mean"),  # a token mean over the batch, as TRL (and the paper code's default)
    "luspo": ("clipped", "sequence_sum"),  # with importance_sampling_level: sequence, as the paper and TRL
}

# Estimators of KL(pi || pi_ref) per token from samples of pi; d = ref_logp - logp.
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": lambda logp, ref: logp - ref,  # unbiased, can be negative
    "k2": lambda logp, ref: 0.5 * (logp - ref) ** 2,  # biased, low variance, >= 0
    "k3": lambda logp, ref: torch.exp(ref - logp) - (ref - logp) - 1,  # unbiased, >= 0 (GRPO's choice)
}


def high_entropy_mask(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """1 on the top ``top_quantile`` fraction of (masked) tokens by entropy, 0 elsewhere (80/20 rule)."""
    values = entropy_BT[mask_BT.bool()].float()
    if values.numel() == 0:
        return torch.zeros_like(mask_BT)
    threshold = torch.quantile(values, 1 - top_quantile)
    return ((entropy_BT >= threshold) & mask_BT.bool()).to(mask_BT.dtype)


@dataclass(frozen=True)
class EngineCorrection:
    """How the engine/trainer importance weights are applied (the config's vllm_importance_sampling_*)."""

    level: str = "sequence"  # "token": a weight per token; "sequence": one per completion (the product of its tokens')
    action: str = "mask"  # "truncate": clamp to [clip_min, clip_max]; "mask": 0 outside it
    clip_max: float = 3.0
    clip_min: float | None = None

    @classmethod
    def from_mode(cls, mode: str, clip_max: float, clip_min: float | None = None) -> "EngineCorrection":
        """From a mode such as ``"token_truncate"`` (level, then action)."""
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


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    counts: BatchCounts,
    settings: LossSettings = LossSettings(),
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
    objective = POLICY_OBJECTIVES[LOSS_TYPES[settings.loss_type][0]]
    chosen = {"kl": settings.beta > 0, "off_policy_mask": settings.off_policy_mask_threshold is not None,
              "aux_loss": bool(settings.router_aux_loss_coef), "entropy_coef": settings.entropy_bonus.enabled}
    return frozenset(objective.reports) | {name for name, on in chosen.items() if on}
