"""One GRPO step, in the order of the algorithm:

    generate    G completions per prompt with the rollout engine
    score       every reward function, combined with reward_weights; DAPO's dynamic sampling
                replaces groups without a reward spread
    advantage   group-relative, over the rewards of every process
    log-probs   of the old policy (only where it moves before the batch's last use; else the
                training forward's own) and of the reference (only when beta > 0)
    loss, step  the clipped surrogate over micro-batches, gradient clipping, AdamW, the schedule

A step is one generation round and the optimizer steps taken on it: one by default, several with
``steps_per_generation`` (windows of the batch) or ``num_iterations`` (passes over it). ``grpo_step``
reads the run's fixed parts (``StepParts``) and where the run stands (``Progress``), and returns
what it produced (``StepResult``); the stages are functions of their own, which ``covey verify``
calls as the step does. Groups stay whole inside a process's batch; under several processes
(``covey.train.distributed``) rewards are gathered before the advantage and the loss counts and
gradients are summed over the processes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from covey import core
from covey.config import GRPOConfig
from covey.agents import Agent
from covey.data import PromptSampler, extra_columns
from covey.models import Reference, autocast, policy_weights
from covey.rewards import RewardFunc, RewardPool, TrainerState, reward_context, reward_name, score_completions
from covey.rollout import Rollout, RolloutEngine, SamplingParams, left_pad
from covey.train import generation
from covey.train.asynchronous import AsyncGeneration
from covey.train.batch import FixedLogprobs, Progress, Prompts, Samples, ScoredBatch, StepResult, Update
from covey.train.distributed import World
from covey.train.forward import SequenceBatch, TrainingForward
from covey.train.sharding import PolicyCopy, grad_norm_value
from covey.vision import batch_images


@dataclass(frozen=True)
class Rewards:
    """The run's reward functions, their weights, and the worker pool that runs the slow ones."""

    funcs: list[RewardFunc]
    weights: list[float]
    pool: RewardPool | None = None

    @functools.cached_property
    def weights_F(self) -> torch.Tensor:
        return torch.tensor(self.weights, dtype=torch.float64)

    @functools.cached_property
    def names(self) -> list[str]:
        return [reward_name(f) for f in self.funcs]


@dataclass(frozen=True)
class StepParts:
    """What a step works with, set up once per run (``GRPOTrainer`` builds it)."""

    args: GRPOConfig
    world: World
    model: torch.nn.Module
    reference: Reference | None  # None when beta == 0
    engine: RolloutEngine
    tokenizer: Any
    eos_ids: list[int]  # the model's end tokens
    prompts: Prompts
    rewards: Rewards
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampling: SamplingParams  # how the training rounds sample
    loss_settings: core.LossSettings
    correction: core.EngineCorrection | None  # for an engine whose log-probs are not exact (None: turned off)
    agent: Agent | None = None  # tools and an environment: episodes of several turns (None: one completion)
    rollout_func: Callable[[list], dict] | None = None  # the user's own generation, TRL's rollout_func
    training_forward: torch.nn.Module | None = None  # the pass that trains, under train() (World.data_parallel; None: the model's)
    # under fsdp: the sharded passes around the policy and the frozen reference, through which every pass of
    # theirs runs, and the whole copy of the policy that an engine in this process samples from
    policy_pass: torch.nn.Module | None = None
    reference_pass: torch.nn.Module | None = None
    policy_copy: PolicyCopy | None = None
    # under async_generation: the worker that samples the next rounds while this one trains
    asynchronous: AsyncGeneration | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


class StepEvents(Protocol):
    """What a step tells the trainer around each of its optimizer steps (for transformers' callbacks)."""

    def step_begin(self, global_step: int) -> None:
        """Before an optimizer step (the first of a round: before the round samples); ``global_step``
        steps are taken."""

    def step_end(self, update: Update) -> bool:
        """After the optimizer step ``update``; True stops the round there."""


def grpo_step(parts: StepParts, sampler: PromptSampler, progress: Progress,
              events: StepEvents | None = None) -> StepResult:
    """One generation round of the next prompts of ``sampler`` and the optimizer steps on it, up to
    max_steps. The step stops early after max_consecutive_bad_steps skipped steps in a row, or where
    ``events`` says so."""
    args = parts.args
    started = time.perf_counter()
    if events is not None:
        events.step_begin(progress.global_step)
    # 1-2. generate and score (under async_generation: take the round the worker sampled ahead)
    if parts.asynchronous is not None:
        generated = parts.asynchronous.take(progress.global_step)
    else:
        with sampling_from_policy(parts):
            generated = generate_and_score(parts, sampler, progress)
    # 3. advantages, over the rewards of every process
    batch, reward_errors = with_advantages(parts, generated.samples, generated.reward_errors)
    progress = dataclasses.replace(progress, rounds_sampled=progress.rounds_sampled + generated.rounds,
                                   reward_errors=progress.reward_errors + reward_errors)
    # 4. the log-probs held fixed over the batch's optimizer steps
    fixed = fixed_logprobs(parts, batch)
    # 5-6. the loss over each window of micro-batches, and an optimizer step
    updates, timings, last = [], dict(generated.timings), started
    for window, policy_unchanged in optimizer_windows(parts, batch.samples.size, progress.global_step):
        if events is not None and updates:
            events.step_begin(progress.global_step)
        t_train = time.perf_counter()
        totals, grad_norm, progress = optimizer_step(parts, batch, fixed, window, policy_unchanged, progress)
        if parts.asynchronous is None:  # else the worker loads the weights each of its rounds is sampled with
            parts.engine.policy_changed(parts.model)
        if parts.policy_copy is not None:
            parts.policy_copy.policy_changed()
        if parts.reference is not None and args.sync_ref_model and progress.global_step % args.ref_model_sync_steps == 0:
            parts.reference.sync(args.ref_model_mixup_alpha)
        now = time.perf_counter()
        updates.append(Update(progress.global_step, totals, grad_norm, parts.scheduler.get_last_lr()[0],
                              progress.bad_steps, {**timings, "time/train": now - t_train}, now - last, now - started))
        timings, last = {"time/generate": 0.0, "time/score": 0.0}, now
        stop = events is not None and events.step_end(updates[-1])
        if stop or progress.consecutive_bad_steps >= args.max_consecutive_bad_steps:
            break
    if parts.asynchronous is not None:  # the weights the worker samples later rounds with
        parts.asynchronous.publish(parts.model, progress.global_step)
    return StepResult(batch, updates, progress, generated.reward_metrics, generated.dynamic_sampling)


# ---- 1-2. generate and score ---------------------------------------------------------------------


@dataclass(frozen=True)
class Generated:
    """Steps 1-2 of one step: its samples, and what their generation rounds and reward calls counted."""

    samples: Samples
    rounds: int  # generation rounds drawn (more than one under dynamic sampling)
    reward_errors: int  # reward calls that failed under reward_errors: skip, in this process
    reward_metrics: dict[str, list[float]]  # what reward functions logged with log_metric
    dynamic_sampling: dict[str, float]  # dynamic sampling's counts (empty when off)
    timings: dict[str, float]  # time/generate, time/score


@dataclass
class _RewardCalls:
    """What the reward calls of one step leave beside their scores: a step's own, kept by no one after it."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0
    warn: bool = True  # the first failure of a run is shown, once

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))


def generate_and_score(parts: StepParts, sampler: PromptSampler | None, progress: Progress,
                       indices: list[int] | None = None) -> Generated:
    """Steps 1-2 for this process's share of the next prompts of ``sampler`` (or the training rows at
    ``indices``, without dynamic sampling); ``progress`` says where the run stands."""
    calls, timings = _RewardCalls(warn=progress.reward_errors == 0), {"time/generate": 0.0, "time/score": 0.0}

    def sample(rows: list[int], round_number: int) -> Samples:
        epoch = sampler.progress if sampler is not None else 0.0
        state = TrainerState(global_step=progress.global_step, max_steps=parts.args.max_steps, epoch=epoch)
        return sample_round(parts, rows, parts.world.seed(parts.args.seed + round_number), state, calls, timings)

    samples = sample(indices if indices is not None else next_prompts(parts, sampler), progress.rounds_sampled)
    rounds, counts = 1, {}
    if parts.args.dynamic_sampling and indices is None:
        samples, extra, counts = refill(parts, samples, lambda: next_prompts(parts, sampler),
                                        lambda rows, k: sample(rows, progress.rounds_sampled + k))
        rounds += extra
    return Generated(samples, rounds, calls.errors, calls.metrics, counts, timings)


def score_prompts(parts: StepParts, indices: list[int]) -> ScoredBatch:
    """Steps 1-3 on the training rows at ``indices``, outside the training loop (``covey generate``,
    ``covey verify``): G completions each, their rewards and advantages."""
    batch, _ = with_advantages(parts, generate_and_score(parts, None, Progress(), indices).samples)
    return batch


def next_prompts(parts: StepParts, sampler: PromptSampler) -> list[int]:
    """The training rows of this process's share of the sampler's next prompts (drawn together by all)."""
    return parts.world.share(next(sampler))


def sample_round(parts: StepParts, indices: list[int], seed: int, state: TrainerState, calls: _RewardCalls,
                 timings: dict[str, float]) -> Samples:
    """One generation round of the training rows at ``indices``: G completions each, decoded and scored."""
    args, G = parts.args, parts.args.num_generations
    t0 = time.perf_counter()
    rows = [parts.prompts.rows[i] for i in indices for _ in range(G)]
    made = generation.generate(parts.engine, parts.tokenizer, rows, [parts.prompts.ids[i] for i in indices], G,
                               parts.sampling, seed, args.strip_reasoning, parts.agent,
                               [i for i in indices for _ in range(G)], parts.rollout_func, args.max_prompt_length,
                               args.prompt_overflow, parts.eos_ids)
    rollout = made.rollout
    t1 = time.perf_counter()
    rewards_BF, logged_columns = score(parts, rows, made.completions, made.completion_ids, state, calls, made.columns)
    timings["time/generate"] += t1 - t0
    timings["time/score"] += time.perf_counter() - t1
    loss_mask_BT = loss_mask(rollout, args.mask_truncated_completions)
    totals_B = core.weighted_reward_sum(rewards_BF, parts.rewards.weights_F).tolist()
    records = [{"prompt": r["prompt"], "completion": text, "answer": r.get("answer"),
                "rewards": {name: _none_if_nan(v) for name, v in zip(parts.rewards.names, rewards_BF[i].tolist())},
                "reward": _none_if_nan(totals_B[i]), "finish_reason": rollout.finish_reasons[i]}
               for i, (r, text) in enumerate(zip(rows, made.texts))]
    for i, record in enumerate(records):
        if made.episodes is not None:
            record["episode"] = made.episodes[i]
        # what reward functions logged with log_extra, beside (never over) what is recorded already
        record.update({column: values[i] for column, values in logged_columns.items() if column not in record})
    prompt_ids_BP, prompt_mask_BP = left_pad(made.prompt_ids, parts.tokenizer.pad_token_id)
    sequences = SequenceBatch(prompt_ids_BP, prompt_mask_BP, rollout.completion_ids_BT, rollout.completion_mask_BT,
                              batch_images(made.prompt_ids))
    return Samples(sequences, loss_mask_BT, rollout.sampling_logp_BT, rewards_BF, rollout.finish_reasons, records)


def loss_mask(rollout: Rollout, mask_truncated_completions: bool) -> torch.Tensor:
    """The tokens the loss trains: those the model sampled (never what a tool or the environment wrote),
    less every token of a completion cut at the length limit under mask_truncated_completions. (B, T)"""
    mask_BT = rollout.sampled_mask_BT.clone()
    if mask_truncated_completions:
        mask_BT[torch.tensor([reason == "length" for reason in rollout.finish_reasons])] = 0
    return mask_BT


def score(parts: StepParts, rows: list[dict], completions: list, completion_ids: list, state: TrainerState,
          calls: _RewardCalls, columns: dict[str, list] | None = None) -> tuple[torch.Tensor, dict[str, list]]:
    """Every reward function on the batch, (B, F); and the columns they logged with ``log_extra`` (a
    value per completion). ``columns``: given beside the dataset's (``environments``, a rollout_func's
    own). Failures under reward_errors: skip are counted."""
    args, errors, logged_columns = parts.args, [], {}

    def log_extra(column: str, values: list) -> None:
        if len(values) != len(rows):
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {len(rows)} completions")
        logged_columns[str(column)] = [v.item() if callable(getattr(v, "item", None)) else v for v in values]

    context = reward_context(state, calls.log_metric, log_extra)
    rewards_BF = score_completions(parts.rewards.funcs, [r["prompt"] for r in rows], completions, completion_ids,
                                   {**extra_columns(rows), **(columns or {})}, args.reward_errors, args.reward_timeout, errors,
                                   parts.rewards.pool, context)
    calls.errors += len(errors)
    if errors and calls.warn:
        calls.warn = False
        name, index, reason = errors[0]
        where = "" if index is None else f" on completion {index}"
        warnings.warn(f"reward function {name!r} {reason}{where}; scored None where it failed "
                      "(reward_errors: skip). Shown once; the count is logged as rewards/errors.", stacklevel=2)
    return rewards_BF, logged_columns


def refill(parts: StepParts, samples: Samples, draw, sample) -> tuple[Samples, int, dict[str, float]]:
    """DAPO dynamic sampling: drop groups whose rewards are all equal (they carry no signal) and sample
    new prompts (``draw()``, then ``sample(rows, k)`` for the k-th extra round) until the batch is full
    again or the round cap is reached. (the samples, the extra rounds, their counts)"""
    args, G = parts.args, parts.args.num_generations
    wanted = args.generation_batch_size // G
    kept, n_kept, dropped, rounds = [], 0, 0, 0
    current: Samples | None = samples
    while True:
        if current is not None:
            _, zero_std_N = core.group_advantages(core.weighted_reward_sum(current.rewards_BF, parts.rewards.weights_F), G)
            groups = [g for g in range(len(zero_std_N)) if not zero_std_N[g]][: wanted - n_kept]
            dropped += int(zero_std_N.sum())
            if groups:
                kept.append(current.select([g * G + j for g in groups for j in range(G)]))
                n_kept += len(groups)
        # every process draws its next prompts while any one needs more, so that they keep to one order
        if not parts.world.any(n_kept < wanted) or rounds >= args.dynamic_sampling_max_rounds:
            break
        rounds += 1
        indices = draw()
        # a process that has enough passes its prompts of the round over (their round number is used all the same)
        current = sample(indices, rounds) if n_kept < wanted else None
    counts = {"dynamic_sampling/dropped_groups": float(dropped), "dynamic_sampling/extra_rounds": float(rounds),
              "dynamic_sampling/kept_groups": float(n_kept)}
    if not kept:  # every group was constant: train on the last batch (all advantages are 0)
        return current, rounds, counts
    return Samples.concat(kept, parts.tokenizer.pad_token_id), rounds, counts


# ---- 3. advantages ---------------------------------------------------------------------------------


def with_advantages(parts: StepParts, samples: Samples, reward_errors: int = 0) -> tuple[ScoredBatch, int]:
    """Step 3: group-relative advantages over the rewards of every process (each keeps its own rows');
    and the reward errors of all of them."""
    args, world, G = parts.args, parts.world, parts.args.num_generations
    rewards_per_process, errors = zip(*world.gather((samples.rewards_BF, reward_errors)))
    advantages_B, zero_std_N = core.advantages_from_rewards(
        torch.cat(rewards_per_process), parts.rewards.weights_F, G, args.scale_rewards,
        args.multi_objective_aggregation)
    first = sum(len(rewards) for rewards in rewards_per_process[:world.rank])  # this process's rows
    last = first + samples.size
    return ScoredBatch(samples, advantages_B[first:last].float(), zero_std_N[first // G:last // G]), sum(errors)


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
    samples = batch.samples
    correction = parts.correction if not sampled_exactly(parts) else None
    old_BT = weights = ref_BT = None
    if policy_moves_before_last_use(parts.args):
        old_BT = logprobs_no_grad(parts, parts.model, samples.sequences)
        if correction is not None:
            weights = core.engine_importance_weights(old_BT, samples.sampling_logp_BT, samples.loss_mask_BT.float(),
                                                     correction)
    if parts.reference is not None:
        with parts.reference.model() as ref_model:
            ref_BT = logprobs_no_grad(parts, ref_model, samples.sequences)
    return FixedLogprobs(old_BT, ref_BT, correction, weights)


def sampled_exactly(parts: StepParts) -> bool:
    """Whether the sampling log-probs are the trainer's own (an engine that computes exactly what the
    training forward does); a rollout_func's come from its own sampler, an asynchronous worker's from an
    older policy, and under a repetition penalty from logits the trainer's forward does not penalise:
    those never count as such."""
    return (parts.engine.exact_logprobs and parts.rollout_func is None and not parts.args.async_generation
            and parts.sampling.repetition_penalty == 1.0)  # a penalty on the tokens before is no part of the trainer's


@torch.no_grad()
def logprobs_no_grad(parts: StepParts, model: torch.nn.Module, sequences: SequenceBatch) -> torch.Tensor:
    """Full-batch log-probs (B, T) padded to the batch width, in micro-batches; in eval mode (no
    dropout), whatever mode the model was left in."""
    args = parts.args
    B, T = sequences.completion_ids_BT.shape
    out = torch.zeros(B, T)
    was_training = model.training
    model.eval()
    forward = logprob_pass(parts, model)
    try:
        for start in range(0, B, args.per_device_train_batch_size):
            rows = slice(start, start + args.per_device_train_batch_size)
            with autocast(parts.device, args.bf16):
                logp, _ = forward(sequences.rows(rows), parts.sampling.distribution, False)
            out[rows, : logp.shape[1]] = logp.float().cpu()
    finally:
        model.train(was_training)
    return out


def logprob_pass(parts: StepParts, model: torch.nn.Module) -> torch.nn.Module:
    """The pass that computes ``model``'s log-probs: under fsdp the sharded one around it (the policy's or
    the reference's), else a plain ``TrainingForward``."""
    sharded = (p for p in (parts.policy_pass, parts.reference_pass) if p is not None and p.model is model)
    return next(sharded, None) or TrainingForward(model)


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


def optimizer_step(parts: StepParts, batch: ScoredBatch, fixed: FixedLogprobs, window: slice,
                   policy_unchanged: bool, progress: Progress) -> tuple[dict[str, float], float, Progress]:
    """Steps 5-6: the loss over the micro-batches of ``window`` and one optimizer step; (the loss
    statistics summed over micro-batches and processes, the gradient norm, the progress after it).
    ``policy_unchanged``: no step was taken on the batch yet, so the old log-probs are the current ones."""
    args, model, samples = parts.args, parts.model, batch.samples
    model.train()
    B, device = samples.size, parts.device
    rows_in_window = window.stop - window.start
    generation_tokens = float(samples.loss_mask_BT.sum())
    # the sizes of the optimizer step, over every process: each normalises by them, and the summed
    # gradients are those of the whole step
    step = parts.world.sum({
        "sequences": rows_in_window,
        "tokens": generation_tokens * rows_in_window / max(B, 1),  # the generation batch's tokens, per optimizer step
        "micro_batches": math.ceil(rows_in_window / args.per_device_train_batch_size)})
    counts = core.BatchCounts(int(step["sequences"]), step["tokens"], int(step["micro_batches"]),
                              args.max_completion_length)
    engine_weights = fixed.engine_weights
    from_forward = fixed.correction is not None and engine_weights is None  # weights from the training forward
    if from_forward:
        width = 1 if fixed.correction.level == "sequence" else samples.loss_mask_BT.shape[1]
        engine_weights = torch.ones(B, width)
    settings = parts.loss_settings
    bonus = settings.entropy_bonus
    entropy_coef = bonus.applied(progress.entropy_coef, progress.last_entropy)  # the same for every micro-batch
    # the off-policy mask measures drift from the policy that sampled: the engine's own log-probs where they
    # differ from the trainer's (drift between the two included), else the old policy's
    behaviour_from_engine = settings.off_policy_mask_threshold is not None and not sampled_exactly(parts)
    totals: dict[str, float] = {"loss": 0.0, **core.LossStats().as_dict()}  # summed over the micro-batches
    if parts.training_forward is None and parts.world.size > 1:
        raise RuntimeError("several processes train through World.data_parallel (GRPOTrainer.train sets it up)")
    forward = parts.training_forward or logprob_pass(parts, model)
    starts = range(window.start, window.stop, args.per_device_train_batch_size)
    if not starts and parts.world.size > 1:  # no rows of its own: its share of the gradients is zero
        take_part_without_rows(parts, forward, samples)
    for start in starts:
        rows = slice(start, min(start + args.per_device_train_batch_size, window.stop))
        micro = samples.sequences.rows(rows)
        T = micro.completion_ids_BT.shape[1]
        mask_BT = samples.loss_mask_BT[rows, :T].to(device)
        last = start == starts[-1]
        with gradients_summed_if(forward, last), autocast(device, args.bf16):
            logp_BT, entropy_BT, *router_aux = forward(micro, parts.sampling.distribution, True, bonus.enabled,
                                                       settings.router_aux_loss_coef != 0)
        reuse = fixed.old_BT is None or policy_unchanged
        old_BT = logp_BT.detach() if reuse else fixed.old_BT[rows, :T].to(device)
        ref_BT = None if fixed.ref_BT is None else fixed.ref_BT[rows, :T].to(device)
        if from_forward:
            computed = core.engine_importance_weights(old_BT, samples.sampling_logp_BT[rows, :T].to(device),
                                                      mask_BT.float(), fixed.correction)
            engine_weights[rows, :computed.shape[1]] = computed.cpu()
        weights = None if engine_weights is None else engine_weights[rows, :T].to(device)
        behaviour_BT = samples.sampling_logp_BT[rows, :T].to(device) if behaviour_from_engine else old_BT
        loss, stats = core.policy_loss(logp_BT, old_BT, batch.advantages_B[rows].to(device), mask_BT, counts,
                                       settings, ref_BT, entropy_BT, weights, behaviour_BT, entropy_coef,
                                       *router_aux)
        with gradients_summed_if(forward, last):  # DistributedDataParallel averages; the step's gradient is the sum
            (loss * parts.world.size).backward()
        totals["loss"] += float(loss.detach())
        for key, value in stats.as_dict().items():
            totals[key] += value
    if engine_weights is not None:  # over the trained tokens (token level) or the sequences
        counted = samples.loss_mask_BT.float() if engine_weights.shape[1] > 1 else torch.ones_like(engine_weights)
        totals.update(engine_weight_sum=float((engine_weights * counted).sum()), engine_counted=float(counted.sum()),
                      engine_masked=float(((engine_weights == 0) * counted).sum()))
    totals = parts.world.sum(totals)
    grad_norm, progress = apply_gradients(parts, progress)
    if bonus.enabled:
        progress = adapt_entropy_coef(bonus, totals, progress)
        totals["entropy_coef"] = progress.entropy_coef  # as TRL logs it: after this step's move
    return totals, grad_norm, progress


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
        micro = SequenceBatch(prompt, torch.ones_like(prompt), torch.tensor([[parts.eos_ids[0]]]),
                              torch.ones(1, 1, dtype=torch.long), batch_images(parts.prompts.ids[:1]))
    with autocast(parts.device, parts.args.bf16):
        logp_BT, _ = forward(micro, parts.sampling.distribution, True, False)
    (logp_BT.sum() * 0.0).backward()


def adapt_entropy_coef(bonus: core.EntropyBonus, totals: dict[str, float], progress: Progress) -> Progress:
    """Under adaptive entropy control, the coefficient after an optimizer step whose trained tokens (of
    every process, ``totals``) had the mean entropy it measures, which the next step's gating reads;
    else ``progress`` as it is. Every process computes the same from the same totals."""
    if not bonus.adaptive:
        return progress
    entropy = totals["entropy_bonus_sum"] / max(totals["entropy_bonus_tokens"], 1.0)
    return dataclasses.replace(progress, entropy_coef=bonus.moved(progress.entropy_coef, entropy), last_entropy=entropy)


def apply_gradients(parts: StepParts, progress: Progress) -> tuple[float, Progress]:
    """Clip the accumulated gradients, step the optimizer and the schedule; (the gradient norm, the
    progress after the step). Non-finite gradients skip the update, and are counted."""
    params = [p for p in parts.model.parameters() if p.requires_grad]  # summed over the processes already
    clip = parts.args.max_grad_norm if parts.args.max_grad_norm > 0 else float("inf")
    grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(params, clip))
    if math.isfinite(grad_norm):
        parts.optimizer.step()
        bad, in_a_row = progress.bad_steps, 0
    else:
        bad, in_a_row = progress.bad_steps + 1, progress.consecutive_bad_steps + 1
    parts.scheduler.step()
    parts.optimizer.zero_grad(set_to_none=True)
    return grad_norm, dataclasses.replace(progress, global_step=progress.global_step + 1, bad_steps=bad,
                                          consecutive_bad_steps=in_a_row)


# ---- several processes sharing one engine -------------------------------------------------------------


@contextlib.contextmanager
def sampling_from_policy(parts: StepParts):
    """Around a round's (or an evaluation's) sampling: the engine's weights are the policy's
    (``push_shared_policy``); under fsdp the whole copy an engine in this process samples from is freed
    after it."""
    push_shared_policy(parts)
    try:
        yield
    finally:
        if parts.policy_copy is not None:
            parts.policy_copy.release()


def push_shared_policy(parts: StepParts) -> None:
    """Before sampling. Under fsdp, the whole copy that an engine in this process samples from takes the
    policy's new weights. Several processes sampling from one copy of the weights (a vLLM or covey server):
    the first pushes the policy if it changed since its last push (sharded: gathered with the others'
    help), and the others learn which copy holds it."""
    engine, world = parts.engine, parts.world
    if parts.policy_copy is not None:  # every process, from the shards
        parts.policy_copy.refresh(parts.policy_pass, parts.model)
    if world.size == 1 or not engine.shared_by_processes or not engine.policy_stale:
        return
    if parts.policy_pass is not None and not world.is_main:  # the first gathers the shards with the others' help
        collections.deque(policy_weights(parts.model, tied_copy=True), maxlen=0)
    holder = world.on_main(lambda: engine.push_policy(parts.model))
    if not world.is_main:
        engine.follow_pushes(holder)


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value
