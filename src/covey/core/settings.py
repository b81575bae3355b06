"""The knobs of the policy loss (what the config's loss fields select), the entropy bonus and its
adaptive control, and the sizes of the batch a micro-batch belongs to."""

from __future__ import annotations

from dataclasses import dataclass


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
