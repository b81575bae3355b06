"""What the step's parts gain while ``train()`` runs, each a context that gives the parts with it and
takes it down after: the training pass whose gradients are summed over the processes, and the worker
that samples the next rounds ahead (async_generation)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Iterator

from covey.data import PromptSampler
from covey.train import setup
from covey.train.asynchronous import AsyncGeneration, AsyncSchedule
from covey.train.batch import Progress
from covey.train.forward import TrainingForward
from covey.train.step import StepParts, generate_and_score


@contextlib.contextmanager
def gradients_summed(parts: StepParts) -> Iterator[StepParts]:
    """Over several processes, DistributedDataParallel over the training pass. It is released at the end,
    while the process group is still open: released after it is closed (at exit, say), gloo's teardown can
    deadlock against the thread that finishes its last transfers. Sharded, FSDP2 reduces the gradients."""
    forward = parts.policy_pass or parts.world.data_parallel(
        TrainingForward(parts.model), static_graph=parts.args.gradient_checkpointing)
    try:
        yield dataclasses.replace(parts, training_forward=forward)
    finally:
        del forward
        gc.collect()  # its reducer sits in reference cycles


@contextlib.contextmanager
def generating_ahead(parts: StepParts, sampler: PromptSampler, progress: Progress,
                     in_flight: dict | None) -> Iterator[StepParts]:
    """Under async_generation, the worker that samples the next rounds (first those ``in_flight``, which
    a resumed checkpoint held); without it, the parts as they are."""
    if not parts.args.async_generation:
        yield parts
        return
    args, tokenizer, eos_ids = parts.args, parts.tokenizer, parts.eos_ids
    worker = AsyncGeneration(parts, sampler, AsyncSchedule.from_args(args),
                             lambda model: setup.build_engine(args, model, tokenizer, eos_ids),
                             generate_and_score, progress, in_flight)
    with worker:
        yield dataclasses.replace(parts, asynchronous=worker)
