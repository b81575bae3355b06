"""Rollout engines: token ids in; completion ids, sampling log-probs and finish reasons out.

An engine knows nothing of rewards, datasets or the trainer. Anything with a ``generate`` method
of the ``RolloutEngine`` shape can be passed to the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from covey.core import completion_mask
from covey.errors import ConfigError
from covey.models import autocast, plain_model

if TYPE_CHECKING:
    from covey.config import GRPOConfig


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


@dataclass
class Rollout:
    """Completions of a batch of prompts; rows of one prompt are contiguous (G per prompt)."""

    completion_ids_BT: torch.Tensor  # (B, T) long, padded with pad_token_id after the end
    completion_mask_BT: torch.Tensor  # (B, T) long, 1 up to and including EOS
    sampling_logp_BT: torch.Tensor  # (B, T) float, log-prob of each token under the sampling distribution
    finish_reasons: list[str]  # per row: "eos", "stop" (a stop string) or "length"

    @property
    def lengths_B(self) -> torch.Tensor:
        return self.completion_mask_BT.sum(1)


class RolloutEngine(Protocol):
    """Engines that keep their own copy of the weights (vLLM, a ``covey server``) also have
    ``policy_changed(model)`` (see ``OwnWeights``), which the trainer calls after every optimizer step.
    Engines that sample with the policy module itself (fast, hf) have no such method."""

    # False when the sampling log-probs may differ from the trainer's float32 forward (bf16, vLLM):
    # the trainer then applies the engine/trainer importance-sampling correction
    exact_logprobs: bool

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 seed: int | None = None) -> Rollout: ...


class OwnWeights:
    """For engines that keep their own copy of the weights: after ``policy_changed(model)`` the weights
    are pushed once, at the next ``generate`` (however many optimizer steps came before it).
    Subclasses implement ``_push_weights(model)`` and call ``_push_if_stale()`` first in ``generate``."""

    unsynced_policy: torch.nn.Module | None = None

    def policy_changed(self, model: torch.nn.Module) -> None:
        self.unsynced_policy = model

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s current weights (LoRA merged) now."""
        self._push_weights(model)
        self.unsynced_policy = None

    def _push_if_stale(self) -> None:
        if self.unsynced_policy is not None:
            self.sync_weights(self.unsynced_policy)

    def _push_weights(self, model: torch.nn.Module) -> None:
        raise NotImplementedError


def make_engine(name: str, model: torch.nn.Module, tokenizer, eos_token_ids: list[int],
                args: GRPOConfig | None = None) -> RolloutEngine:
    """The rollout engine called ``name`` ("fast", "hf" or "vllm") over ``model``, set up from the
    run's config ``args`` (which "vllm" needs; the local engines sample in float32 without it)."""
    bf16 = args is not None and args.sample_in_bf16(next(model.parameters()).device)
    if name == "hf":
        return HFEngine(model, tokenizer.pad_token_id, eos_token_ids, bf16)
    if name == "fast":
        from covey.fast_rollout import FastEngine

        return FastEngine(model, tokenizer.pad_token_id, eos_token_ids, tokenizer, bf16)
    if name == "vllm":
        if args is None:
            raise ConfigError("rollout_engine: vllm needs the run's config to build its engine")
        if args.vllm_mode == "server":
            from covey.server import ServerEngine

            return ServerEngine.from_config(args, tokenizer.pad_token_id, policy=model)
        from covey.vllm_engine import VLLMEngine

        return VLLMEngine(args, tokenizer.pad_token_id, eos_token_ids, policy=model)
    raise ValueError(f"rollout engine {name!r} is not one of fast, hf, vllm")


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


class HFEngine:
    """Sampling with ``transformers`` ``generate`` on the policy itself."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_ids: list[int], bf16: bool = False):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        self.bf16 = bf16
        self.exact_logprobs = not bf16

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 seed: int | None = None) -> Rollout:
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        input_ids, attention_mask = left_pad(repeated, self.pad_token_id)
        device = next(self.model.parameters()).device
        if seed is not None:
            torch.manual_seed(seed)
        from transformers import GenerationConfig

        # A fresh generation config: settings saved with the model (repetition penalty, its own
        # temperature, ...) must not change the distribution the trainer believes it sampled from.
        if params.stop:
            raise ValueError("stop strings are supported by the 'fast' rollout engine only")
        sampling = {} if params.greedy else dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                                 min_p=params.min_p or None)
        generation_config = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=not params.greedy, **sampling,
            pad_token_id=self.pad_token_id, eos_token_id=self.eos_token_ids,
            repetition_penalty=params.repetition_penalty, output_scores=True, return_dict_in_generate=True)
        # generate() fills unset values from the model's own config, so swap in an empty one
        holder = plain_model(self.model)
        was_training, saved_config = self.model.training, holder.generation_config
        self.model.eval()
        holder.generation_config = GenerationConfig()
        try:
            with autocast(device, self.bf16):
                out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                          generation_config=generation_config)
        finally:
            self.model.train(was_training)
            holder.generation_config = saved_config
        completion_ids_BT = out.sequences[:, input_ids.shape[1]:].cpu()
        # scores are the processed logits actually sampled from (temperature, top-k, top-p applied)
        scores_BTV = torch.stack(out.scores, dim=1).float().cpu()
        sampling_logp_BT = torch.log_softmax(scores_BTV, dim=-1).gather(-1, completion_ids_BT.unsqueeze(-1)).squeeze(-1)
        mask_BT = completion_mask(completion_ids_BT, self.eos_token_ids)
        completion_ids_BT = completion_ids_BT.masked_fill(mask_BT == 0, self.pad_token_id)
        sampling_logp_BT = sampling_logp_BT.masked_fill(mask_BT == 0, 0.0)
        ends_with_eos = torch.isin(completion_ids_BT, torch.tensor(self.eos_token_ids)) & (mask_BT == 1)
        finish_reasons = ["eos" if row.any() else "length" for row in ends_with_eos]
        return Rollout(completion_ids_BT, mask_BT, sampling_logp_BT, finish_reasons)
