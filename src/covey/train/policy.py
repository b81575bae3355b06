"""The policy: the model that trains, the passes that compute its log-probs, its reference, and the
optimizer that moves it.

Every log-prob of a model comes from one pass (``pass_for``): under fsdp the sharded one around it,
else a plain ``TrainingForward``. The pass that trains is that pass, but while ``train()`` runs with
several processes and no sharding it is DistributedDataParallel around it (``summing_gradients``),
which sums the gradients of every process in the backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch

from covey.config import GRPOConfig
from covey.models import Reference, plain_model
from covey.plan import this_device
from covey.train.batch import Progress
from covey.train.distributed import World
from covey.train.forward import TrainingForward
from covey.train.sharding import grad_norm_value


@dataclass
class Policy:
    """The model that trains and what computes and moves it."""

    model: torch.nn.Module
    reference: Reference | None  # None when beta == 0
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    # under fsdp: the sharded passes around the policy and the frozen reference, through which every pass of
    # theirs runs
    sharded_pass: torch.nn.Module | None = None
    sharded_reference_pass: torch.nn.Module | None = None
    logprob_budget_bytes: int | None = None  # the log-prob pass's chunk (logprob_budget_mib)
    summed_pass: torch.nn.Module | None = field(default=None, init=False)  # while train() runs (summing_gradients)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def pass_for(self, model: torch.nn.Module) -> torch.nn.Module:
        """The pass that computes ``model``'s log-probs (the policy's or its reference's)."""
        sharded = (p for p in (self.sharded_pass, self.sharded_reference_pass) if p is not None and p.model is model)
        return next(sharded, None) or TrainingForward(model, self.logprob_budget_bytes)

    def training_pass(self, world: World) -> torch.nn.Module:
        """The pass whose backward gives the step's gradients."""
        if self.summed_pass is None and world.size > 1:
            raise RuntimeError("several processes train through Policy.summing_gradients (GRPOTrainer.train uses it)")
        return self.summed_pass or self.pass_for(self.model)

    @contextlib.contextmanager
    def summing_gradients(self, world: World, gradient_checkpointing: bool) -> Iterator[None]:
        """While training: over several processes, DistributedDataParallel over the training pass (sharded,
        FSDP2 reduces the gradients itself). It is released at the end, while the process group is still
        open: released after it is closed (at exit, say), gloo's teardown can deadlock against the thread
        that finishes its last transfers."""
        self.summed_pass = self.sharded_pass or world.data_parallel(TrainingForward(self.model, self.logprob_budget_bytes),
                                                                    static_graph=gradient_checkpointing)
        try:
            yield
        finally:
            self.summed_pass = None
            gc.collect()  # DistributedDataParallel's reducer sits in reference cycles

    def apply_gradients(self, max_grad_norm: float, progress: Progress) -> tuple[float, Progress]:
        """Clip the accumulated gradients, step the optimizer and the schedule; (the gradient norm, the
        progress after the step). Non-finite gradients skip the update, and are counted."""
        params = [p for p in self.model.parameters() if p.requires_grad]  # summed over the processes already
        clip = max_grad_norm if max_grad_norm > 0 else float("inf")
        grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(params, clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
            bad, in_a_row = progress.bad_steps, 0
        else:
            bad, in_a_row = progress.bad_steps + 1, progress.consecutive_bad_steps + 1
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, dataclasses.replace(progress, global_step=progress.global_step + 1, bad_steps=bad,
                                              consecutive_bad_steps=in_a_row)

    def sync_reference_if_due(self, sync_steps: int | None, alpha: float, global_step: int) -> None:
        """TR-DPO's moving reference: towards the policy every ``sync_steps`` optimizer steps (None: never)."""
        if self.reference is not None and sync_steps and global_step % sync_steps == 0:
            self.reference.sync(alpha)


def logprob_budget_for(args: GRPOConfig, policy: torch.nn.Module, world: World) -> int:
    """The log-prob pass's budget in bytes (``GRPOConfig.logprob_budget_bytes``) for the policy's vocabulary, with
    the memory its device has free now that it is loaded (each process's share of the CPU's)."""
    vocab = plain_model(policy).get_output_embeddings().weight.shape[0]
    return args.logprob_budget_bytes(vocab, this_device(args.use_cpu, world.size).available)
