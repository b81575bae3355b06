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

Every variant is one entry of one of these tables; ``LOSS_TYPES``, the registry of loss types, names
the (objective, aggregation) pairs that the config's ``loss_type`` selects. The config's choices are
these tables' keys. The papers: GRPO (DeepSeekMath,
arXiv:2402.03300), Dr. GRPO (arXiv:2503.20783), DAPO (arXiv:2503.14476), GSPO (arXiv:2507.18071),
CISPO (MiniMax-M1, arXiv:2506.13585), SAPO (arXiv:2511.20347), VESPO (arXiv:2602.10693), dual-clip
PPO (arXiv:1912.09729), two-sided clipping (INTELLECT-2, arXiv:2505.07291), the off-policy mask
(DeepSeek-V3.2, arXiv:2512.02556), adaptive entropy control (Skywork-OR1, arXiv:2505.22312),
k1/k2/k3 (Schulman, "Approximating KL divergence", 2020).

The modules: ``logprobs`` (the sampling distribution, log-probs, entropies, masks), ``advantages``,
``settings`` (the loss's knobs, the entropy bonus, the batch's counts), ``objectives``, ``corrections``
(top-entropy tokens, the engine/trainer weights, the off-policy mask) and ``loss`` (``policy_loss``, its
tables and ``LossStats``). Every name is importable from ``covey.core`` itself, and the training step calls
the maths through this namespace (``core.policy_loss``).
"""

from covey.core.advantages import (ADVANTAGE_EPS, REWARD_AGGREGATIONS, REWARD_SCALES, advantages_from_rewards,
                                   group_advantages, nanstd, weighted_reward_sum)
from covey.core.corrections import (ENGINE_CORRECTION_MODES, EngineCorrection, engine_importance_weights, high_entropy_mask,
                                    off_policy_mask)
from covey.core.logprobs import (LOGPROB_CHUNK_BYTES, LOGPROB_CHUNK_TOKENS, TokenDistribution, completion_mask,
                                 entropy_of, length_mask, log_softmax_backward, logprob_at, logprob_budget, logprob_chunk_tokens,
                                 logprob_working_rows, softmax_backward, token_logprobs, truncated_away)
from covey.core.loss import (IMPORTANCE_LEVELS, KL_ESTIMATORS, LOSS_NORMALISERS, LOSS_TYPES, LossStats, LossType,
                             policy_loss, reported_metrics)
from covey.core.objectives import POLICY_OBJECTIVES, Objective, PolicyTerms, vespo_weights
from covey.core.settings import BatchCounts, EntropyBonus, LossSettings

__all__ = [
    "ADVANTAGE_EPS", "ENGINE_CORRECTION_MODES", "IMPORTANCE_LEVELS", "KL_ESTIMATORS", "LOGPROB_CHUNK_BYTES", "LOGPROB_CHUNK_TOKENS", "LOSS_NORMALISERS", "LOSS_TYPES",
    "POLICY_OBJECTIVES", "REWARD_AGGREGATIONS", "REWARD_SCALES", "BatchCounts", "EngineCorrection", "EntropyBonus",
    "LossSettings", "LossStats", "LossType", "Objective", "PolicyTerms", "TokenDistribution", "advantages_from_rewards",
    "completion_mask", "engine_importance_weights", "entropy_of", "group_advantages", "high_entropy_mask", "length_mask", "log_softmax_backward", "logprob_at", "logprob_budget", "logprob_chunk_tokens", "logprob_working_rows",
    "nanstd", "off_policy_mask", "policy_loss", "reported_metrics", "softmax_backward", "token_logprobs", "truncated_away",
    "vespo_weights", "weighted_reward_sum",
]
