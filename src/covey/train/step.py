"""One GRPO step, in the order of the algorithm:

    generate    G completions per prompt from the sampler                    covey.train.rounds
    score       every reward function, combined with reward_weights; DAPO's dynamic sampling
                replaces groups without a reward spread                      covey.train.rounds
    advantage   group-relative, over the rewards of every process            covey.train.rounds
    log-probs   of the old policy (only where it moves before the batch's last use; else the
                training forward's own) and of the reference (only when beta > 0)  covey.train.update
    loss, step  the clipped surrogate over micro-batches, gradient clipping, AdamW, the schedule
                                                                             covey.train.update

A step is one generation round and the optimizer steps taken on it: one by default, several with
``steps_per_generation`` (windows of the batch) or ``num_iterations`` (passes over it). ``grpo_step``
reads the run's parts (``StepParts``: the policy, the sampler, the prompts, the rewards) and where the run
stands (``Progress``), and returns what it produced (``StepResult``). Groups stay whole inside a
process's batch; under several processes (``covey.train.distributed``) rewards are gathered before the
advantage and the loss counts and gradients are summed over the processes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from covey.data import PromptSampler
from covey.train.batch import Progress, StepResult, Update
from covey.train.parts import StepParts
from covey.train.rounds import generate_and_score, with_advantages
from covey.train.update import fixed_logprobs, optimizer_step, optimizer_windows


class StepEvents(Protocol):
    """What a step tells the trainer around each of its optimizer steps (for transformers' callbacks)."""

    def step_begin(self, global_step: int) -> None:
        """Before an optimizer step (the first of a round: before the round samples); ``global_step``
        steps are taken."""

    def step_end(self, update: Update) -> bool:
        """After the optimizer step ``update``; True stops the round there."""


def grpo_step(parts: StepParts, prompt_sampler: PromptSampler, progress: Progress,
              events: StepEvents | None = None) -> StepResult:
    """One generation round of the next prompts of ``prompt_sampler`` and the optimizer steps on it, up to
    max_steps. The step stops early after max_consecutive_bad_steps skipped steps in a row, or where
    ``events`` says so."""
    args, policy, sampler = parts.args, parts.policy, parts.sampler
    started = last = time.perf_counter()
    if events is not None:
        events.step_begin(progress.global_step)
    # 1-2. generate and score (under async_generation: the round the worker sampled ahead)
    generated = sampler.round(policy, parts.world, progress.global_step,
                              lambda: generate_and_score(parts, prompt_sampler, progress))
    # 3. advantages, over the rewards of every process
    batch, reward_errors = with_advantages(parts, generated.samples, generated.reward_errors)
    progress = dataclasses.replace(progress, rounds_sampled=progress.rounds_sampled + generated.rounds,
                                   reward_errors=progress.reward_errors + reward_errors)
    # 4. the log-probs held fixed over the batch's optimizer steps
    t_logprobs = time.perf_counter()
    fixed = fixed_logprobs(parts, batch)
    # 5-6. the loss over each window of micro-batches, and an optimizer step
    updates, timings = [], {**generated.timings, "time/logprobs": time.perf_counter() - t_logprobs}
    for window, policy_unchanged in optimizer_windows(parts, batch.samples.size, progress.global_step):
        if events is not None and updates:
            events.step_begin(progress.global_step)
        t_train = time.perf_counter()
        totals, grad_norm, progress = optimizer_step(parts, batch, fixed, window, policy_unchanged, progress)
        sampler.policy_moved(policy)
        policy.sync_reference_if_due(args.ref_model_sync_steps if args.sync_ref_model else None,
                                     args.ref_model_mixup_alpha, progress.global_step)
        now = time.perf_counter()
        updates.append(Update(progress.global_step, totals, grad_norm, policy.scheduler.get_last_lr()[0],
                              progress.bad_steps, {**timings, "time/train": now - t_train}, now - last, now - started))
        timings, last = {"time/generate": 0.0, "time/score": 0.0, "time/logprobs": 0.0}, now
        stop = events is not None and events.step_end(updates[-1])
        if stop or progress.consecutive_bad_steps >= args.max_consecutive_bad_steps:
            break
    sampler.round_trained(policy, progress.global_step)
    return StepResult(batch, updates, progress, generated.reward_metrics, generated.dynamic_sampling)
