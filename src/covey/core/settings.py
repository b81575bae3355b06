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
    """The knobs of the policy loss: what the config's loss fields select, so it has no defaults of its
    own (the config's are the only ones; ``covey.train.setup.loss_settings`` builds it from a config)."""

    loss_type: str  # a key of LOSS_TYPES
    epsilon_low: float
    epsilon_high: float
    delta: float | None  # two-sided clipping: cap on the unclipped ratio (INTELLECT-2)
    clip_ratio_c: float | None  # dual-clip: for A < 0 the objective never drops below c * A
    importance_sampling_level: str  # "sequence" = GSPO
    beta: float
    kl_estimator: str
    use_bias_correction_kl: bool  # multiply the KL term by the importance ratio
    top_entropy_quantile: float  # train only on the top fraction of tokens by entropy
    sapo_temperature_pos: float  # SAPO's gate temperature where A > 0
    sapo_temperature_neg: float  # and where A <= 0
    vespo_k_pos: float  # VESPO's kernel W^k e^(lambda (1 - W)) where A >= 0
    vespo_lambda_pos: float
    vespo_k_neg: float  # and where A < 0
    vespo_lambda_neg: float
    off_policy_mask_threshold: float | None  # DeepSeek-V3.2's delta (None: no off-policy mask)
    entropy_bonus: EntropyBonus
    router_aux_loss_coef: float  # mixture-of-experts models: weight of the router's load-balancing loss


@dataclass(frozen=True)
class BatchCounts:
    """Sizes of the optimisation batch a micro-batch belongs to, so micro-batches add up exactly."""

    sequences: int  # completions in the optimizer step
    tokens: float  # token normaliser of dapo / cispo (tokens of the generation batch per optimizer step)
    micro_batches: int  # micro-batches accumulated into the optimizer step
    max_completion_length: int
