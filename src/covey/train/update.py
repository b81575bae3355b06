"""Steps 4-6 of a GRPO step, on a scored batch: the log-probs held fixed while the policy trains on it
(the old policy's, the reference's), then for each optimizer step the clipped surrogate over its
micro-batches and the update. Under several processes the loss counts and the gradients are summed over
them. ``covey verify`` and evaluation's loss call these as the step does."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch

from covey import core
from covey.config import GRPOConfig
from covey.models import autocast, float32_products
from covey.train.batch import FixedLogprobs, Progress, Samples, ScoredBatch
from covey.train.forward import SequenceBatch
from covey.train.parts import StepParts
from covey.vision import batch_images


# ---- 4. log-probs ------------------------------------------------------------------------------------


def policy_moves_before_last_use(args: GRPOConfig) -> bool:
    """Whether the policy takes an optimizer step before it last trains on a batch (several windows or
    passes): then the old policy's log-probs need a pass of their own."""
    return args.num_iterations > 1 or args.micro_batches_per_generation > args.gradient_accumulation_steps


def fixed_logprobs(parts: StepParts, batch: ScoredBatch) -> FixedLogprobs:
    """Step 4: the old policy's log-probs where the policy moves before the batch's last use (until its
    first step the training forward gives them, the ratio exactly 1), the reference's when beta > 0,
    and the engine/trainer correction where the engine's log-probs are not exact (its weights from the
    old policy's log-probs, else from the training forward's, which costs no extra pass)."""
    samples, policy, correction = batch.samples, parts.policy, parts.sampler.correction
    old_BT = weights = ref_BT = None
    if policy_moves_before_last_use(parts.args):
        old_BT = logprobs_no_grad(parts, policy.model, samples.sequences)
        if correction is not None:
            weights = core.engine_importance_weights(old_BT, samples.sampling_logp_BT, samples.loss_mask_BT.float(),
                                                     correction)
    if policy.reference is not None:
        with policy.reference.model() as ref_model:
            ref_BT = logprobs_no_grad(parts, ref_model, samples.sequences)
    return FixedLogprobs(old_BT, ref_BT, correction, weights)


@torch.no_grad()
def logprobs_no_grad(parts: StepParts, model: torch.nn.Module, sequences: SequenceBatch) -> torch.Tensor:
    """``model``'s log-probs of the completions (B, T) padded to the batch width, in micro-batches; in eval
    mode (no dropout), whatever mode the model was left in."""
    args = parts.args
    B, T = sequences.completion_ids_BT.shape
    out = torch.zeros(B, T)
    was_training = model.training
    model.eval()
    forward = parts.policy.pass_for(model)
    try:
        for start in range(0, B, args.per_device_train_batch_size):
            rows = slice(start, start + args.per_device_train_batch_size)
            with autocast(parts.policy.device, args.bf16):
                logp, _ = forward(sequences.rows(rows), parts.sampler.sampling.distribution, False)
            out[rows, : logp.shape[1]] = logp.float().cpu()
    finally:
        model.train(was_training)
    return out


# ---- 5-6. loss and optimizer step ---------------------------------------------------------------------


def optimizer_windows(parts: StepParts, B: int, global_step: int) -> list[tuple[slice, bool]]:
    """The rows of each optimizer step on a batch of B rows, up to max_steps, each with whether the
    policy is still the one that sampled (no step taken on the batch yet): (micro-batches per generation
    / gradient_accumulation_steps) windows, each visited num_iterations times."""
    args = parts.args
    window = args.per_device_train_batch_size * args.gradient_accumulation_steps
    # as many optimizer steps in every process (one whose batch came out smaller takes part without rows)
    windows = parts.world.max(math.ceil(B / window))
    steps = [(slice(min(first, B), min(first + window, B)), iteration == 0 and first == 0)
             for iteration in range(args.num_iterations) for first in range(0, windows * window, window)]
    return steps[:max(0, args.max_steps - global_step)]


@dataclass(frozen=True)
class StepTerms:
    """What every micro-batch of one optimizer step shares."""

    counts: core.BatchCounts  # the step's sizes over every process, which the loss normalises by
    entropy_coef: float  # the entropy bonus's coefficient, after its gating
    behaviour_from_engine: bool  # the off-policy mask measures drift from the engine's log-probs (else the old policy's)
    policy_unchanged: bool  # no step taken on the batch yet: the old log-probs are the training forward's own


def optimizer_step(parts: StepParts, batch: ScoredBatch, fixed: FixedLogprobs, window: slice,
                   policy_unchanged: bool, progress: Progress) -> tuple[dict[str, float], float, Progress]:
    """Steps 5-6: the loss over the micro-batches of ``window`` and one optimizer step; (the loss
    statistics summed over micro-batches and processes, the gradient norm, the progress after it).
    ``policy_unchanged``: no step was taken on the batch yet, so the old log-probs are the current ones."""
    args, samples, settings = parts.args, batch.samples, parts.loss_settings
    parts.policy.model.train()
    bonus = settings.entropy_bonus
    terms = StepTerms(step_counts(parts, samples, window),
                      bonus.applied(progress.entropy_coef, progress.last_entropy),
                      settings.off_policy_mask_threshold is not None and not parts.sampler.exact, policy_unchanged)
    engine_weights = EngineWeights(fixed, samples)
    forward = parts.policy.training_pass(parts.world)
    starts = range(window.start, window.stop, args.per_device_train_batch_size)
    if not starts and parts.world.size > 1:
        take_part_without_rows(parts, forward, samples)
    totals: dict[str, float] = {"loss": 0.0, **core.LossStats().as_dict()}  # summed over the micro-batches
    for start in starts:
        rows = slice(start, min(start + args.per_device_train_batch_size, window.stop))
        loss, stats = micro_batch_loss(parts, forward, batch, fixed, engine_weights, rows, terms,
                                       last=start == starts[-1])
        totals["loss"] += float(loss.detach())
        for key, value in stats.as_dict().items():
            totals[key] += value
    totals = parts.world.sum({**totals, **engine_weights.totals(samples.loss_mask_BT)})
    grad_norm, progress = parts.policy.apply_gradients(args.max_grad_norm, progress)
    if bonus.enabled:
        progress = adapt_entropy_coef(bonus, totals, progress)
        totals["entropy_coef"] = progress.entropy_coef  # as TRL logs it: after this step's move
    return totals, grad_norm, progress


def step_counts(parts: StepParts, samples: Samples, window: slice) -> core.BatchCounts:
    """The sizes of an optimizer step over every process: each normalises by them, and the summed
    gradients are those of the whole step."""
    args, B = parts.args, samples.size
    rows = window.stop - window.start
    step = parts.world.sum({
        "sequences": rows,
        "tokens": float(samples.loss_mask_BT.sum()) * rows / max(B, 1),  # the generation batch's tokens, per step
        "micro_batches": math.ceil(rows / args.per_device_train_batch_size)})
    return core.BatchCounts(int(step["sequences"]), step["tokens"], int(step["micro_batches"]),
                            args.max_completion_length)


def micro_batch_loss(parts: StepParts, forward: torch.nn.Module, batch: ScoredBatch, fixed: FixedLogprobs,
                     engine_weights: EngineWeights, rows: slice, terms: StepTerms,
                     last: bool) -> tuple[torch.Tensor, core.LossStats]:
    """The loss of the micro-batch ``rows`` and its backward (the gradients summed over the processes on
    the step's ``last`` micro-batch); (the loss, its statistics)."""
    samples, device, settings = batch.samples, parts.policy.device, parts.loss_settings
    micro = samples.sequences.rows(rows)
    T = micro.completion_ids_BT.shape[1]
    mask_BT = samples.loss_mask_BT[rows, :T].to(device)
    sampling_BT = samples.sampling_logp_BT[rows, :T].to(device)
    with gradients_summed_if(forward, last), autocast(device, parts.args.bf16):
        logp_BT, entropy_BT, *router_aux = forward(micro, parts.sampler.sampling.distribution, True,
                                                   settings.entropy_bonus.enabled, settings.router_aux_loss_coef != 0)
    reuse = fixed.old_BT is None or terms.policy_unchanged
    old_BT = logp_BT.detach() if reuse else fixed.old_BT[rows, :T].to(device)
    ref_BT = None if fixed.ref_BT is None else fixed.ref_BT[rows, :T].to(device)
    weights = engine_weights.for_rows(rows, T, old_BT, sampling_BT, mask_BT)
    behaviour_BT = sampling_BT if terms.behaviour_from_engine else old_BT
    loss, stats = core.policy_loss(logp_BT, old_BT, batch.advantages_B[rows].to(device), mask_BT, terms.counts,
                                   settings, ref_BT, entropy_BT, weights, behaviour_BT, terms.entropy_coef, *router_aux)
    # DistributedDataParallel averages; the step's gradient is the sum
    with gradients_summed_if(forward, last), float32_products(device, parts.args.bf16):
        (loss * parts.world.size).backward()
    return loss, stats


class EngineWeights:
    """The engine/trainer correction's importance weights over a batch, (B, T) at token level or (B, 1)
    per sequence: those computed from the old policy's log-probs, else filled micro-batch by micro-batch
    from the training forward's (which costs no extra pass); none without a correction."""

    def __init__(self, fixed: FixedLogprobs, samples: Samples):
        self.correction, self.weights = fixed.correction, fixed.engine_weights
        self.from_forward = self.correction is not None and self.weights is None
        if self.from_forward:
            width = 1 if self.correction.level == "sequence" else samples.loss_mask_BT.shape[1]
            self.weights = torch.ones(samples.size, width)

    def for_rows(self, rows: slice, T: int, old_BT: torch.Tensor, sampling_BT: torch.Tensor,
                 mask_BT: torch.Tensor) -> torch.Tensor | None:
        """The weights of the micro-batch ``rows`` (T tokens wide), given its old and sampling log-probs."""
        if self.from_forward:
            computed = core.engine_importance_weights(old_BT, sampling_BT, mask_BT.float(), self.correction)
            self.weights[rows, :computed.shape[1]] = computed.cpu()
        return None if self.weights is None else self.weights[rows, :T].to(old_BT.device)

    def totals(self, loss_mask_BT: torch.Tensor) -> dict[str, float]:
        """What the metrics report of them: their sum, the count they are over (the trained tokens at token
        level, else the sequences) and how many are 0."""
        if self.weights is None:
            return {}
        counted = loss_mask_BT.float() if self.weights.shape[1] > 1 else torch.ones_like(self.weights)
        return {"engine_weight_sum": float((self.weights * counted).sum()), "engine_counted": float(counted.sum()),
                "engine_masked": float(((self.weights == 0) * counted).sum())}


def gradients_summed_if(forward: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Where the gradients of several processes are summed: in the backward of an optimizer step's last
    micro-batch only (DistributedDataParallel's no_sync on the others); one process: nowhere."""
    return contextlib.nullcontext() if last or not hasattr(forward, "no_sync") else forward.no_sync()


def take_part_without_rows(parts: StepParts, forward: torch.nn.Module, samples: Samples) -> None:
    """A process whose batch has no rows in this optimizer step (it came out smaller) still takes part in
    the summing of gradients, with zeros: a pass over one row (any row of its batch, else a training
    prompt and an end token) whose loss is multiplied by 0."""
    if samples.size:
        micro = samples.sequences.rows(slice(0, 1))
    else:
        prompt = torch.tensor([parts.prompts.ids[0]])
        micro = SequenceBatch(prompt, torch.ones_like(prompt), torch.tensor([[parts.sampler.eos_ids[0]]]),
                              torch.ones(1, 1, dtype=torch.long), batch_images(parts.prompts.ids[:1]))
    with autocast(parts.policy.device, parts.args.bf16):
        logp_BT, _ = forward(micro, parts.sampler.sampling.distribution, True, False)
    with float32_products(parts.policy.device, parts.args.bf16):
        (logp_BT.sum() * 0.0).backward()


def adapt_entropy_coef(bonus: core.EntropyBonus, totals: dict[str, float], progress: Progress) -> Progress:
    """Under adaptive entropy control, the coefficient after an optimizer step whose trained tokens (of
    every process, ``totals``) had the mean entropy it measures, which the next step's gating reads;
    else ``progress`` as it is. Every process computes the same from the same totals."""
    if not bonus.adaptive:
        return progress
    entropy = totals["entropy_bonus_sum"] / max(totals["entropy_bonus_tokens"], 1.0)
    return dataclasses.replace(progress, entropy_coef=bonus.moved(progress.entropy_coef, entropy), last_entropy=entropy)
