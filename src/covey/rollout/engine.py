"""The rollout engine interface and the values it passes: token ids in; completion ids, sampling
log-probs and finish reasons out.

An engine knows nothing of rewards, datasets or the run's config: it is built from ``EngineSettings``
and asked for completions with ``SamplingParams``. ``RolloutEngine`` declares everything the trainer
asks of one; ``SamplesWithPolicy`` (engines that sample with the policy module itself) and
``OwnWeights`` (engines that hold a copy of the weights, which the trainer pushes) give the two kinds
their behaviour, and any object of the ``RolloutEngine`` shape can be handed to the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from covey.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    stop: tuple[str, ...] = ()  # strings that end a completion (kept in it)
    greedy: bool = False

    def __post_init__(self):
        """The same bounds as the config's, for callers (and a server's clients) that bypass it."""
        for ok, what in ((self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
                         (self.temperature > 0, "temperature must be positive (greedy: true samples greedily)"),
                         (0 < self.top_p <= 1, "top_p must be in (0, 1]"), (self.top_k >= 0, "top_k must be >= 0"),
                         (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
                         (self.repetition_penalty > 0, "repetition_penalty must be positive")):
            if not ok:
                raise ConfigError(f"sampling settings {self}: {what}")


@dataclass(frozen=True)
class Rollout:
    """Completions of a batch of prompts; rows of one prompt are contiguous (G per prompt). A completion
    is every token after its prompt: the model's, and in an episode of several turns also those a tool
    or the environment wrote between them, which ``sampled_mask_BT`` tells apart."""

    completion_ids_BT: torch.Tensor  # (B, T) long, padded with pad_token_id after the end
    completion_mask_BT: torch.Tensor  # (B, T) long, 1 on the completion's tokens (EOS included), 0 on padding
    sampling_logp_BT: torch.Tensor  # (B, T) float, log-prob of each sampled token under the distribution it was drawn from
    finish_reasons: list[str]  # per row: "eos", "stop" (a stop string) or "length"
    # (B, T) long, 1 where the model sampled the token, 0 where something else wrote it (and on padding);
    # the completion mask when not given: a single turn is the model's alone
    sampled_mask_BT: torch.Tensor | None = None

    def __post_init__(self):
        if self.sampled_mask_BT is None:
            object.__setattr__(self, "sampled_mask_BT", self.completion_mask_BT)

    @property
    def lengths_B(self) -> torch.Tensor:
        return self.completion_mask_BT.sum(1)


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is built with: the part of a run's settings the engines read (each its own fields)."""

    bf16: bool = False  # fast, hf: sample in bfloat16 (log-probs then differ slightly from the trainer's)
    dtype: str = "float32"  # vllm: the dtype of its copy of the weights
    seed: int = 0  # vllm: its engine's seed
    max_model_len: int | None = None  # vllm: the longest prompt + completion, in tokens
    gpu_memory_utilization: float = 0.3  # vllm: the fraction of GPU memory it may take
    trust_remote_code: bool = False  # vllm: run the model folder's own code
    server_host: str = "127.0.0.1"  # server: where the `covey server` listens
    server_port: int = 8000
    server_timeout: float = 240.0  # server: seconds to wait for it to answer its health check


class RolloutEngine(Protocol):
    """What the trainer asks of a rollout engine."""

    # False where the sampling log-probs may differ from the trainer's float32 forward (bf16, vLLM): the
    # trainer then applies the engine/trainer importance-sampling correction
    exact_logprobs: bool
    # one copy of the weights that every training process samples from (a covey server): the first
    # process pushes the policy to it (``push_policy``), the others are told where it went
    shared_by_processes: bool

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 seed: int | None = None) -> Rollout: ...

    def policy_changed(self, model: torch.nn.Module) -> None:
        """After every optimizer step: an engine with a copy of the weights takes the new ones before it
        next samples."""

    @property
    def policy_stale(self) -> bool:
        """Whether its copy of the weights is older than the policy."""

    def push_policy(self, model: torch.nn.Module) -> str | None:
        """Push ``model``'s weights (LoRA merged) now; an id of the copy that holds them (None: no copy)."""

    def follow_pushes(self, holder: str | None) -> None:
        """In a process that does not push (not the first of several sharing the engine): the policy was
        pushed to the copy ``holder``."""


def missing_members(engine: object) -> list[str]:
    """The members of ``RolloutEngine`` that ``engine`` lacks (none for an engine the trainer can use)."""
    declared = [*RolloutEngine.__annotations__, *(name for name, member in vars(RolloutEngine).items()
                                                   if not name.startswith("_") and (callable(member) or isinstance(member, property)))]
    return [name for name in declared if not hasattr(engine, name)]


class SamplesWithPolicy:
    """For engines that sample with the policy module itself: nothing to push, ever."""

    shared_by_processes = False
    policy_stale = False
    exact_logprobs: bool

    def policy_changed(self, model: torch.nn.Module) -> None:
        """The module is the policy: nothing to do."""

    def push_policy(self, model: torch.nn.Module) -> str | None:
        return None

    def follow_pushes(self, holder: str | None) -> None:
        """Nothing is pushed."""


class OwnWeights:
    """For engines that keep their own copy of the weights: after ``policy_changed(model)`` the weights
    are pushed once, at the next ``generate`` (however many optimizer steps came before it).
    Subclasses implement ``_push_weights(model)`` and call ``_push_if_stale()`` first in ``generate``."""

    shared_by_processes = False
    unsynced_policy: torch.nn.Module | None = None

    def policy_changed(self, model: torch.nn.Module) -> None:
        self.unsynced_policy = model

    @property
    def policy_stale(self) -> bool:
        return self.unsynced_policy is not None

    def push_policy(self, model: torch.nn.Module) -> str | None:
        """Push ``model``'s current weights (LoRA merged) now."""
        self._push_weights(model)
        self.unsynced_policy = None
        return None

    def follow_pushes(self, holder: str | None) -> None:
        self.unsynced_policy = None

    def _push_if_stale(self) -> None:
        if self.unsynced_policy is not None:
            self.push_policy(self.unsynced_policy)

    def _push_weights(self, model: torch.nn.Module) -> None:
        raise NotImplementedError


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into (ids_BT, attention_mask_BT)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq)
            mask[row, width - len(seq):] = 1
    return ids, mask

