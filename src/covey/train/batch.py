"""The typed values a GRPO step passes from stage to stage, each built whole and never changed.

Shape letters: B completions (rows), G group size, N groups (prompts), F reward functions,
P prompt tokens, T completion tokens.

    Rollout (covey.rollout)  what an engine returns: completion ids, sampling log-probs, finish reasons
    Samples                  a round's completions with their rewards and the masks the loss uses
    ScoredBatch              Samples with their group-relative advantages
    FixedLogprobs            the old policy's and the reference's log-probs, held fixed while training
    Update                   one optimizer step's statistics
    Progress                 the run's counters and controller state, which a checkpoint carries
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from covey.core import EngineCorrection
from covey.train.forward import SequenceBatch


@dataclass(frozen=True)
class Prompts:
    """The training prompts: their rows and, in the same order, their token ids."""

    rows: list[dict]
    ids: list[list[int]]


@dataclass(frozen=True)
class Samples:
    """A generation round's completions and their rewards, one row per completion; the G rows of a
    prompt are contiguous. A row may hold several model turns with tokens that a tool or the
    environment wrote between them: those are attended to (``sequences``) but never trained
    (``loss_mask_BT``)."""

    sequences: SequenceBatch  # prompts (B, P) left-padded and completions (B, T) right-padded, with attention masks
    loss_mask_BT: torch.Tensor  # (B, T) 1 on the tokens the loss trains: the model's own, less any mask_truncated_completions drops
    sampling_logp_BT: torch.Tensor  # (B, T) each sampled token's log-prob under the distribution the engine drew it from
    rewards_BF: torch.Tensor  # (B, F) float64 per reward function, NaN where one said None
    finish_reasons: list[str]  # (B,) "eos", "stop" or "length"
    records: list[dict]  # (B,) prompt, completion, answer, rewards, ...: what completions.jsonl records

    @property
    def size(self) -> int:
        return len(self.finish_reasons)

    def select(self, rows: list[int]) -> Samples:
        """The given rows, in that order."""
        index = torch.tensor(rows, dtype=torch.long)
        seq = self.sequences
        return Samples(SequenceBatch(seq.prompt_ids_BP[index], seq.prompt_mask_BP[index], seq.completion_ids_BT[index],
                                     seq.completion_mask_BT[index],
                                     None if seq.images is None else tuple(seq.images[i] for i in rows)),
                       self.loss_mask_BT[index], self.sampling_logp_BT[index], self.rewards_BF[index],
                       [self.finish_reasons[i] for i in rows], [self.records[i] for i in rows])

    @staticmethod
    def concat(parts: list[Samples], pad_token_id: int) -> Samples:
        """The rows of ``parts`` in order, padded to common widths."""
        if len(parts) == 1:
            return parts[0]
        P = max(p.sequences.prompt_ids_BP.shape[1] for p in parts)
        T = max(p.sequences.completion_ids_BT.shape[1] for p in parts)

        def left(x: torch.Tensor, value: float) -> torch.Tensor:
            return F.pad(x, (P - x.shape[1], 0), value=value)

        def right(x: torch.Tensor, value: float) -> torch.Tensor:
            return F.pad(x, (0, T - x.shape[1]), value=value)

        cat = torch.cat
        return Samples(SequenceBatch(cat([left(p.sequences.prompt_ids_BP, pad_token_id) for p in parts]),
                                     cat([left(p.sequences.prompt_mask_BP, 0) for p in parts]),
                                     cat([right(p.sequences.completion_ids_BT, pad_token_id) for p in parts]),
                                     cat([right(p.sequences.completion_mask_BT, 0) for p in parts]),
                                     _joined_images([p.sequences for p in parts])),
                       cat([right(p.loss_mask_BT, 0) for p in parts]), cat([right(p.sampling_logp_BT, 0.0) for p in parts]),
                       cat([p.rewards_BF for p in parts]),
                       [r for p in parts for r in p.finish_reasons], [r for p in parts for r in p.records])


@dataclass(frozen=True)
class ScoredBatch:
    """Samples with their group-relative advantages: what the loss trains on."""

    samples: Samples
    advantages_B: torch.Tensor  # (B,) float32
    zero_std_N: torch.Tensor  # (N,) bool: groups whose rewards were all equal (their advantages are 0)

    def records(self) -> list[dict]:
        """Each completion's record with its advantage, as completions.jsonl and the console show them."""
        return [{**record, "advantage": advantage}
                for record, advantage in zip(self.samples.records, self.advantages_B.tolist())]

    @staticmethod
    def concat(parts: list[ScoredBatch], pad_token_id: int) -> ScoredBatch:
        """The rows of ``parts`` in order (the batches of several processes, for the metrics)."""
        if len(parts) == 1:
            return parts[0]
        return ScoredBatch(Samples.concat([p.samples for p in parts], pad_token_id),
                           torch.cat([p.advantages_B for p in parts]), torch.cat([p.zero_std_N for p in parts]))


@dataclass(frozen=True)
class FixedLogprobs:
    """The log-probs the loss holds fixed while the policy trains on a batch, and the correction for an
    engine that samples from another distribution than the trainer's forward."""

    old_BT: torch.Tensor | None = None  # (B, T) the sampling policy's, where it moves before the batch's last step; None: the training forward's own (ratio 1)
    ref_BT: torch.Tensor | None = None  # (B, T) the reference's (beta > 0)
    correction: EngineCorrection | None = None  # the engine/trainer correction this batch gets (None: none)
    engine_weights: torch.Tensor | None = None  # (B, T) or (B, 1) its weights from old_BT; None: from the training forward


@dataclass(frozen=True)
class Update:
    """One optimizer step on a batch, as its metrics report it."""

    global_step: int  # the optimizer step it was, counted from 1
    totals: dict[str, float]  # summed over micro-batches and processes: loss, policy_loss, tokens, entropy_sum, ...
    grad_norm: float  # before clipping; NaN or inf for a step that was skipped
    learning_rate: float  # for the next step (after this one's schedule step)
    bad_steps: int  # steps skipped for NaN/inf gradients in the run so far
    timings: dict[str, float]  # time/generate, time/score, time/logprobs (its round's, on the round's first step), time/train
    step_time: float  # seconds since the previous step ended (for the first, since its round began)
    round_time: float  # seconds since its round began


@dataclass(frozen=True)
class Progress:
    """Where a run stands: the counters a checkpoint carries beside the model, optimizer and data."""

    global_step: int = 0  # optimizer steps taken
    rounds_sampled: int = 0  # generation rounds drawn (round k samples with the run's seed + k)
    bad_steps: int = 0  # optimizer steps skipped for NaN/inf gradients
    consecutive_bad_steps: int = 0  # of those, in a row up to now
    reward_errors: int = 0  # reward calls that failed under reward_errors: skip (all processes)
    entropy_coef: float = 0.0  # the entropy bonus's coefficient now (moved by adaptive control; else the config's)
    last_entropy: float | None = None  # mean entropy of the last optimizer step's trained tokens (adaptive control)


@dataclass(frozen=True)
class Generated:
    """Steps 1-2 of one step: its samples, and what their generation rounds and reward calls counted."""

    samples: Samples
    rounds: int  # generation rounds drawn (more than one under dynamic sampling)
    reward_errors: int  # reward calls that failed under reward_errors: skip, in this process
    reward_metrics: dict[str, list[float]]  # what reward functions logged with log_metric
    dynamic_sampling: dict[str, float]  # dynamic sampling's counts (empty when off)
    timings: dict[str, float]  # time/generate, time/score


@dataclass(frozen=True)
class StepResult:
    """What one step produced: its batch, its optimizer steps, and where the run stands after them."""

    batch: ScoredBatch
    updates: list[Update]
    progress: Progress
    reward_metrics: dict[str, list[float]] = field(default_factory=dict)  # what reward functions logged (log_metric)
    dynamic_sampling: dict[str, float] = field(default_factory=dict)  # DAPO dynamic sampling's counts (when on)


def _joined_images(batches: list[SequenceBatch]) -> tuple | None:
    """The pictures of each row of ``batches`` in order (None: no row of any has one)."""
    if all(b.images is None for b in batches):
        return None
    return tuple(image for b in batches for image in (b.images or (None,) * b.prompt_ids_BP.shape[0]))
