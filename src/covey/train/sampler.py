"""The sampler: what draws the training rounds' completions. The rollout engine with its tokenizer and
sampling settings, the episodes' agent or the user's own ``rollout_func``, the whole copy of the policy an
engine in this process samples from under fsdp, and, while ``train()`` runs under async_generation, the
worker that samples rounds ahead.

The engine learns that the policy moved in one way: after each optimizer step the trainer says so
(``policy_moved``); before sampling (``from_policy``) the weights are taken where they are stale (a whole
copy gathered from the shards, a server pushed by the first process). Under async_generation the worker
samples with the weights each round's schedule names instead (``round_trained`` publishes them).
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch

from covey.agents import Agent
from covey.core import EngineCorrection
from covey.models import policy_weights
from covey.rollout import RolloutEngine, SamplingParams
from covey.train.batch import Generated
from covey.train.distributed import World
from covey.train.policy import Policy
from covey.train.sharding import PolicyCopy


class RoundsAhead(Protocol):
    """What the sampler asks of a worker that samples the training rounds ahead of the trainer
    (``covey.train.asynchronous.AsyncGeneration``, which is built over the step's parts, these among them)."""

    def __enter__(self) -> RoundsAhead: ...
    def __exit__(self, *exc: Any) -> None: ...
    def take(self, global_step: int) -> Generated: ...  # the next round fresh enough to train at global_step
    def publish(self, model: torch.nn.Module, global_step: int) -> None: ...  # the weights later rounds sample with
    def engine_lent(self) -> ContextManager[None]: ...  # the trainer samples with a shared engine meanwhile


@dataclass
class Sampler:
    """The engine side of a run."""

    engine: RolloutEngine
    tokenizer: Any
    eos_ids: list[int]  # the model's end tokens
    sampling: SamplingParams  # how the training rounds sample
    engine_correction: EngineCorrection | None  # for log-probs that are not the trainer's own (None: turned off)
    agent: Agent | None = None  # tools and an environment: episodes of several turns (None: one completion)
    rollout_func: Callable[[list], dict] | None = None  # the user's own generation, TRL's rollout_func
    policy_copy: PolicyCopy | None = None  # under fsdp, the whole copy of the policy an engine here samples from
    async_generation: bool = False  # the rounds are sampled ahead, by an older policy
    processor: Any = None  # a vision-language model's processor, which writes the prompts with pictures (None: text)
    ahead: RoundsAhead | None = field(default=None, init=False)  # the worker, while train() runs

    @property
    def exact(self) -> bool:
        """Whether the sampling log-probs are the trainer's own: an engine that computes exactly what the
        training forward does. A rollout_func's come from its own sampler, an asynchronous worker's from an
        older policy, and under a repetition penalty from logits the trainer's forward does not penalise."""
        return (self.engine.exact_logprobs and self.rollout_func is None and not self.async_generation
                and self.sampling.repetition_penalty == 1.0)

    @property
    def correction(self) -> EngineCorrection | None:
        """The engine/trainer correction the rounds get (None: turned off, or not needed)."""
        return None if self.exact else self.engine_correction

    def round(self, policy: Policy, world: World, global_step: int, sample_now: Callable[[], Generated]) -> Generated:
        """A training round's ``Generated``: the one the worker sampled ahead for ``global_step``, else
        ``sample_now()`` from the policy as it is."""
        if self.ahead is not None:
            return self.ahead.take(global_step)
        with self.from_policy(policy, world):
            return sample_now()

    def policy_moved(self, policy: Policy) -> None:
        """After an optimizer step: the engine's and the whole copy's weights are stale (the worker, ahead,
        loads the weights of each of its rounds itself)."""
        if self.ahead is None:
            self.engine.policy_changed(policy.model)
        if self.policy_copy is not None:
            self.policy_copy.policy_changed()

    def round_trained(self, policy: Policy, global_step: int) -> None:
        """After a round's optimizer steps: the weights the worker samples later rounds with."""
        if self.ahead is not None:
            self.ahead.publish(policy.model, global_step)

    @contextlib.contextmanager
    def from_policy(self, policy: Policy, world: World) -> Iterator[None]:
        """Around sampling (a round, an evaluation): the engine holds the policy's weights. Under fsdp the
        whole copy takes them from the shards (every process), and is freed after. Several processes
        sampling from one copy of the weights (a vLLM or covey server): the first pushes the policy if it
        changed since its last push (sharded: gathered with the others' help), and the others learn which
        copy holds it. The worker, ahead, lends its engine meanwhile."""
        engine = self.engine
        with self.ahead.engine_lent() if self.ahead is not None else contextlib.nullcontext():
            if self.policy_copy is not None:
                self.policy_copy.refresh(policy.sharded_pass, policy.model)
            try:
                if world.size > 1 and engine.shared_by_processes and engine.policy_stale:
                    if policy.sharded_pass is not None and not world.is_main:  # the first gathers with the others' help
                        collections.deque(policy_weights(policy.model, tied_copy=True), maxlen=0)
                    holder = world.on_main(lambda: engine.push_policy(policy.model))
                    if not world.is_main:
                        engine.follow_pushes(holder)
                yield
            finally:
                if self.policy_copy is not None:
                    self.policy_copy.release()

    def whole_policy(self, policy: Policy) -> torch.nn.Module:
        """The policy as a plain module with every weight whole: under fsdp, the whole copy (its weights
        gathered from the shards: every process calls this at once)."""
        if self.policy_copy is None:
            return policy.model
        self.policy_copy.refresh(policy.sharded_pass, policy.model)
        return self.policy_copy.model

    @contextlib.contextmanager
    def generating_ahead(self, worker: RoundsAhead | None) -> Iterator[None]:
        """While train() runs under async_generation, ``worker`` samples the next rounds (None: nothing)."""
        if worker is None:
            yield
            return
        with worker:
            self.ahead = worker
            try:
                yield
            finally:
                self.ahead = None
