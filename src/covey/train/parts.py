"""The run's parts a step works with, set up once per run (``covey.train.assemble`` builds them): the
policy (``covey.train.policy``), the sampler (``covey.train.sampler``), the training prompts, the
rewards, and the loss's settings."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from covey import core
from covey.config import GRPOConfig
from covey.rewards import RewardFunc, RewardPool, reward_name
from covey.rollout import RolloutEngine
from covey.train.batch import Prompts
from covey.train.distributed import World
from covey.train.policy import Policy
from covey.train.sampler import Sampler


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
    """What a step works with."""

    args: GRPOConfig
    world: World
    policy: Policy  # the model that trains, its passes, its reference and its optimizer
    sampler: Sampler  # the engine and what it samples with
    prompts: Prompts  # the training prompts
    rewards: Rewards
    loss_settings: core.LossSettings

    def sampling_with(self, engine: RolloutEngine) -> StepParts:
        """These parts, sampling with ``engine`` (an asynchronous worker's own, verify's)."""
        return dataclasses.replace(self, sampler=dataclasses.replace(self.sampler, engine=engine))

    def stepping_with(self, optimizer: torch.optim.Optimizer) -> StepParts:
        """These parts, the policy's steps taken by ``optimizer`` at its own constant rate (verify's)."""
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        return dataclasses.replace(self, policy=dataclasses.replace(self.policy, optimizer=optimizer,
                                                                     scheduler=scheduler))
