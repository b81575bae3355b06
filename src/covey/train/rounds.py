"""Steps 1-3 of a GRPO step, a generation round: G completions per prompt from the sampler, scored by
every reward function (combined with reward_weights; DAPO's dynamic sampling replaces groups without a
reward spread), and their group-relative advantages over the rewards of every process. ``covey verify``,
``covey generate`` and evaluation's loss call these as the step does."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from covey.errors import warn
from covey import core
from covey.data import PromptSampler, extra_columns
from covey.rewards import TrainerState, reward_context, score_completions
from covey.rollout import Rollout, left_pad
from covey.train import generation
from covey.train.batch import Generated, Progress, Samples, ScoredBatch
from covey.train.forward import SequenceBatch
from covey.train.parts import StepParts
from covey.vision import batch_images


@dataclass
class _RewardCalls:
    """What the reward calls of one step leave beside their scores: a step's own, kept by no one after it."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0
    warn: bool = True  # the first failure of a run is shown, once

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))


def generate_and_score(parts: StepParts, prompt_sampler: PromptSampler | None, progress: Progress,
                       indices: list[int] | None = None) -> Generated:
    """Steps 1-2 for this process's share of the next prompts of ``prompt_sampler`` (or the training rows at
    ``indices``, without dynamic sampling); ``progress`` says where the run stands."""
    calls, timings = _RewardCalls(warn=progress.reward_errors == 0), {"time/generate": 0.0, "time/score": 0.0}

    def sample(rows: list[int], round_number: int) -> Samples:
        epoch = prompt_sampler.progress if prompt_sampler is not None else 0.0
        state = TrainerState(global_step=progress.global_step, max_steps=parts.args.max_steps, epoch=epoch)
        return sample_round(parts, rows, parts.world.seed(parts.args.seed + round_number), state, calls, timings)

    samples = sample(indices if indices is not None else next_prompts(parts, prompt_sampler), progress.rounds_sampled)
    rounds, counts = 1, {}
    if parts.args.dynamic_sampling and indices is None:
        samples, extra, counts = refill(parts, samples, lambda: next_prompts(parts, prompt_sampler),
                                        lambda rows, k: sample(rows, progress.rounds_sampled + k))
        rounds += extra
    return Generated(samples, rounds, calls.errors, calls.metrics, counts, timings)


def score_prompts(parts: StepParts, indices: list[int]) -> ScoredBatch:
    """Steps 1-3 on the training rows at ``indices``, outside the training loop (``covey generate``,
    ``covey verify``): G completions each, their rewards and advantages."""
    batch, _ = with_advantages(parts, generate_and_score(parts, None, Progress(), indices).samples)
    return batch


def next_prompts(parts: StepParts, prompt_sampler: PromptSampler) -> list[int]:
    """The training rows of this process's share of the prompt sampler's next prompts (drawn together by all)."""
    return parts.world.share(next(prompt_sampler))


def sample_round(parts: StepParts, indices: list[int], seed: int, state: TrainerState, calls: _RewardCalls,
                 timings: dict[str, float]) -> Samples:
    """One generation round of the training rows at ``indices``: G completions each, decoded and scored."""
    args, G = parts.args, parts.args.num_generations
    t0 = time.perf_counter()
    rows = [parts.prompts.rows[i] for i in indices for _ in range(G)]
    sampler = parts.sampler
    made = generation.generate(sampler.engine, sampler.tokenizer, rows, [parts.prompts.ids[i] for i in indices], G,
                               sampler.sampling, seed, args.strip_reasoning, sampler.agent,
                               [i for i in indices for _ in range(G)], sampler.rollout_func, args.max_prompt_length,
                               args.prompt_overflow, sampler.eos_ids)
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
    prompt_ids_BP, prompt_mask_BP = left_pad(made.prompt_ids, sampler.tokenizer.pad_token_id)
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
        warn(f"reward function {name!r} {reason}{where}; scored None where it failed "
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
    return Samples.concat(kept, parts.sampler.tokenizer.pad_token_id), rounds, counts


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


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value
