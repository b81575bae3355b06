"""The rollout engine interface and the values it passes: token ids in; completion ids, sampling
log-probs and finish reasons out.

An engine knows nothing of rewards, datasets or the run's config: it is built from ``EngineSettings``
and asked for completions with ``SamplingParams``. ``RolloutEngine`` declares everything the trainer
asks of one; ``SamplesWithPolicy`` (engines that sample with the policy module itself) and
``OwnWeights`` (engines that hold a copy of the weights, which the trainer pushes) give the two kinds
their behaviour, and any object of the ``RolloutEngine`` shape can be handed to the trainer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from covey import core
from covey.errors import ConfigError
from covey.vision import images_of, with_images_of


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
    extra: tuple[tuple[str, Any], ...] = ()  # the engine's own further settings (generation_kwargs): hf and vLLM
    suppress: tuple[int, ...] = ()  # token ids never sampled: a vision-language model's image tokens (hf and vLLM)

    def __post_init__(self):
        """The same bounds as the config's, for callers (and a server's clients) that bypass it."""
        for ok, what in ((self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
                         (self.temperature > 0, "temperature must be positive (greedy: true samples greedily)"),
                         (0 < self.top_p <= 1, "top_p must be in (0, 1]"), (self.top_k >= 0, "top_k must be >= 0"),
                         (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
                         (self.repetition_penalty > 0, "repetition_penalty must be positive")):
            if not ok:
                raise ConfigError(f"sampling settings {self}: {what}")

    @property
    def distribution(self) -> core.TokenDistribution:
        """What each token is drawn from given the model's logits (temperature, top-k, top-p, min-p): the
        trainer computes its log-probs of the same distribution. The repetition penalty is not part of it
        (it depends on the tokens before); its engine/trainer mismatch is corrected as a sampler's is."""
        return core.TokenDistribution(self.temperature, self.top_k, self.top_p, self.min_p, self.suppress)


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


# What an episode's environment does when the model ends a turn: given the row (the episode's place in the
# batch), the ids the model sampled in that turn (up to its end token) and how many more tokens the episode
# may hold, the ids to append before the model's next turn (tool results, an environment's message, the
# opening of the next assistant turn), fewer than that many; or None: the episode is over. Appended ids that
# show pictures carry the episode's pictures from then on (``covey.vision.images_of``).
Respond = Callable[[int, list[int], int], "list[int] | None"]
# how far apart the seeds of an episode's later turns are, when an engine samples them one call at a time
TURN_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is built with: the part of a run's settings the engines read (each its own fields)."""

    bf16: bool = False  # fast, hf: sample in bfloat16 (log-probs then differ slightly from the trainer's)
    dtype: str = "float32"  # vllm: the dtype of its copy of the weights
    seed: int = 0  # vllm: its engine's seed
    max_model_len: int | None = None  # vllm: the longest prompt + completion, in tokens
    gpu_memory_utilization: float = 0.3  # vllm: the fraction of GPU memory it may take (on a CPU: of RAM, for its KV cache)
    trust_remote_code: bool = False  # vllm: run the model folder's own code
    sleep_mode: bool = False  # vllm: offload its weights and free its KV cache between generations
    server_host: str = "127.0.0.1"  # server: where the vLLM (or covey) server listens
    server_port: int = 8000
    server_timeout: float = 240.0  # server: seconds to wait for it to answer its health check
    group_port: int = 0  # server: the port of the weight-transfer group the trainer opens (0: a free one)


class RolloutEngine(Protocol):
    """What the trainer asks of a rollout engine."""

    # False where the sampling log-probs may differ from the trainer's float32 forward (bf16, vLLM): the
    # trainer then applies the engine/trainer importance-sampling correction
    exact_logprobs: bool
    # one copy of the weights that every training process samples from (a vLLM or covey server): the first
    # process pushes the policy to it (``push_policy``), the others are told where it went
    shared_by_processes: bool

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 seed: int | None = None) -> Rollout: ...

    def generate_episodes(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                          seed: int | None, respond: Respond) -> Rollout:
        """Episodes of several turns: after each turn the model ends, ``respond`` gives the tokens to
        append (never sampled, so ``sampled_mask_BT`` is 0 there) or ends the episode.
        ``params.max_new_tokens`` bounds each episode's tokens after its prompt, all of them."""

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


def missing_members(engine: object, episodes: bool = True) -> list[str]:
    """The members of ``RolloutEngine`` that ``engine`` lacks (none for an engine the trainer can use;
    without ``episodes``, one for single completions needs no ``generate_episodes``)."""
    declared = [*RolloutEngine.__annotations__, *(name for name, member in vars(RolloutEngine).items()
                                                   if not name.startswith("_") and (callable(member) or isinstance(member, property)))]
    return [name for name in declared if not hasattr(engine, name) and (episodes or name != "generate_episodes")]


class TurnByTurn:
    """Episodes for an engine that samples one turn per call: ``episodes_by_turns``."""

    pad_token_id: int = 0  # what pads the rows of a rollout past their end

    def generate_episodes(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                          seed: int | None, respond: Respond) -> Rollout:
        return episodes_by_turns(self, prompt_ids, num_generations, params, seed, respond, self.pad_token_id)


def episodes_by_turns(engine: RolloutEngine, prompt_ids: list[list[int]], num_generations: int,
                      params: SamplingParams, seed: int | None, respond: Respond, pad_token_id: int) -> Rollout:
    """Episodes with an engine's ``generate``, one turn per call: each later turn is sampled from the
    whole episode so far (its prompt, the model's turns and the tokens appended between them), so every
    turn costs a prefill of the episode (an engine with a prefix cache, such as vLLM, reuses it). A turn
    that runs past its episode's budget is cut there."""
    budget, G = params.max_new_tokens, num_generations
    prompts = [with_images_of(p, list(p)) for p in prompt_ids for _ in range(G)]
    B = len(prompts)
    ids: list[list[int]] = [[] for _ in range(B)]
    sampled: list[list[int]] = [[] for _ in range(B)]
    logps: list[list[float]] = [[] for _ in range(B)]
    reasons = ["length"] * B
    active, turn, calls = list(range(B)), engine.generate(prompt_ids, G, params, seed), 0
    while True:
        still = []
        for j, row in enumerate(active):
            n = min(int(turn.completion_mask_BT[j].sum()), budget - len(ids[row]))
            turn_ids = turn.completion_ids_BT[j, :n].tolist()
            ids[row] += turn_ids
            sampled[row] += [1] * n
            logps[row] += turn.sampling_logp_BT[j, :n].tolist()
            if n < int(turn.completion_mask_BT[j].sum()) or turn.finish_reasons[j] == "length":
                continue  # the budget is spent: "length"
            room = budget - len(ids[row])
            appended = respond(row, turn_ids, room)
            if appended is None or len(appended) >= room:
                reasons[row] = turn.finish_reasons[j]
                continue
            ids[row] += list(appended)
            sampled[row] += [0] * len(appended)
            logps[row] += [0.0] * len(appended)
            if images_of(appended) is not None:  # the appended messages show pictures: the episode's from here on
                prompts[row] = with_images_of(appended, list(prompts[row]))
            still.append(row)
        if not still:
            break
        active, calls = still, calls + 1
        room = max(budget - len(ids[row]) for row in active)
        turn = engine.generate([continuation(prompts[row], ids[row]) for row in active], 1,
                               dataclasses.replace(params, max_new_tokens=room),
                               None if seed is None else seed + calls * TURN_SEED_STRIDE)
    return padded_rollout(ids, sampled, logps, reasons, pad_token_id)


def continuation(prompt_ids: list[int], episode_ids: list[int]) -> list[int]:
    """What the model's next turn continues: the whole episode so far, its prompt first (and its pictures)."""
    return with_images_of(prompt_ids, prompt_ids + episode_ids)


def padded_rollout(ids: list[list[int]], sampled: list[list[int]], logps: list[list[float]], reasons: list[str],
                   pad_token_id: int) -> Rollout:
    """A ``Rollout`` of episodes given row by row: their ids, which of them the model sampled, and the
    sampled ones' log-probs (0 elsewhere)."""
    B, T = len(ids), max(len(row) for row in ids)
    ids_BT = torch.full((B, T), pad_token_id, dtype=torch.long)
    mask_BT = torch.zeros(B, T, dtype=torch.long)
    sampled_BT = torch.zeros(B, T, dtype=torch.long)
    logp_BT = torch.zeros(B, T)
    for b in range(B):
        n = len(ids[b])
        ids_BT[b, :n], mask_BT[b, :n] = torch.tensor(ids[b], dtype=torch.long), 1
        sampled_BT[b, :n], logp_BT[b, :n] = torch.tensor(sampled[b], dtype=torch.long), torch.tensor(logps[b])
    return Rollout(ids_BT, mask_BT, logp_BT, list(reasons), sampled_BT)


def greedy_once(generate: Callable[[int], Rollout], num_generations: int, params: SamplingParams) -> Rollout:
    """``generate(n)``, asking vLLM for one greedy completion per prompt where ``num_generations`` are
    wanted (vLLM refuses n > 1 with greedy sampling; the samples would all be the same) and repeating it."""
    if not params.greedy or num_generations == 1:
        return generate(num_generations)
    one = generate(1)
    return Rollout(*(t.repeat_interleave(num_generations, dim=0) for t in
                     (one.completion_ids_BT, one.completion_mask_BT, one.sampling_logp_BT)),
                   [r for r in one.finish_reasons for _ in range(num_generations)],
                   one.sampled_mask_BT.repeat_interleave(num_generations, dim=0))


class SamplesWithPolicy(TurnByTurn):
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


class OwnWeights(TurnByTurn):
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

