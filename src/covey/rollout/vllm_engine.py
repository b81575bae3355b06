"""vLLM as a rollout engine, in the trainer's process (``vllm_mode: colocate``).

vLLM holds its own copy of the weights, so before each generation that follows optimizer steps the trainer pushes the
policy into it (``push_policy``); a LoRA policy is pushed as merged weights W + scale * B @ A,
computed beside the training model without touching it. vLLM is asked for the log-prob of each
sampled token under the *processed* distribution (after repetition penalty, temperature, top-k,
top-p and min-p): the distribution it actually sampled from, which is what the engine/trainer
importance-sampling correction needs.

Everything that does not need vLLM itself (sampling settings, output conversion; the merged
weights are ``covey.models.policy_weights``) is a plain function here, so it is tested on any machine.
"""

from __future__ import annotations

import importlib.util
import os
import random
import socket
from typing import Any, Iterable, Iterator

import torch

from covey.core import length_mask
from covey.errors import ConfigError, ModelError
from covey.models import plain_model, policy_weights, resolve_model_path
from covey.rollout.engine import EngineSettings, OwnWeights, Rollout, SamplingParams

INSTALL_HINT = ("install it with pip install 'covey[vllm]' on a machine with a CUDA GPU, "
                "or use rollout_engine: fast")


# ---- sampling settings and outputs --------------------------------------------------------------


def vllm_sampling_kwargs(params: SamplingParams, num_generations: int, eos_token_ids: list[int]) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for covey's ``params`` (seed excluded).

    ``logprobs=0`` returns the log-prob of the sampled token only; the EOS ids are passed as stop
    tokens so every id covey treats as the end also ends vLLM's sampling. Stop strings stay in the
    completion, as with the fast engine."""
    kwargs: dict[str, Any] = dict(
        n=num_generations, max_tokens=params.max_new_tokens, repetition_penalty=params.repetition_penalty,
        stop=list(params.stop), include_stop_str_in_output=True, stop_token_ids=list(eos_token_ids), logprobs=0)
    if params.greedy:  # temperature 0 is vLLM's greedy; the filters would not change the argmax
        kwargs.update(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    else:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p)
    return kwargs


def request_seeds(seed: int | None, num_prompts: int) -> list[int | None]:
    """One seed per prompt (vLLM adds 0..n-1 for the samples of a prompt). Drawn from ``seed`` rather
    than counted up from it, so consecutive rounds (seed, seed + 1, ...) do not reuse streams."""
    if seed is None:
        return [None] * num_prompts
    rng = random.Random(seed)
    return [rng.getrandbits(31) for _ in range(num_prompts)]


def finish_reason(completion: Any) -> str:
    """covey's finish reason of one vLLM ``CompletionOutput``. vLLM says "stop" for both EOS and a
    stop string; ``stop_reason`` holds the string in the second case (a token id or None in the first)."""
    if completion.finish_reason == "length":
        return "length"
    if completion.finish_reason == "stop":
        return "stop" if isinstance(completion.stop_reason, str) else "eos"
    raise ModelError(f"vLLM ended a completion with finish_reason={completion.finish_reason!r} "
                     f"(stop_reason={completion.stop_reason!r}); only 'stop' and 'length' are expected")


def rollout_from_outputs(outputs: list[Any], num_generations: int, pad_token_id: int) -> Rollout:
    """A ``Rollout`` from vLLM's ``RequestOutput`` list (one per prompt, ``n`` completions each),
    padded to the longest completion."""
    rows = []
    for request in outputs:
        if len(request.outputs) != num_generations:
            raise ModelError(f"vLLM returned {len(request.outputs)} completions for a prompt, "
                             f"expected num_generations={num_generations}")
        rows.extend(sorted(request.outputs, key=lambda c: c.index))
    B, T = len(rows), max(len(c.token_ids) for c in rows)
    ids_BT = torch.full((B, T), pad_token_id, dtype=torch.long)
    logp_BT = torch.zeros(B, T)
    lengths_B = torch.tensor([len(c.token_ids) for c in rows])
    for row, completion in enumerate(rows):
        tokens = list(completion.token_ids)
        if completion.logprobs is None or len(completion.logprobs) != len(tokens):
            raise ModelError("vLLM returned no log-prob for some sampled tokens; the engine must ask for logprobs=0")
        ids_BT[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logp_BT[row, : len(tokens)] = torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, tokens)])
    mask_BT = length_mask(lengths_B, T)
    return Rollout(ids_BT, mask_BT, logp_BT, [finish_reason(c) for c in rows])


# ---- the engine ------------------------------------------------------------------------------------


def model_source(model: torch.nn.Module) -> str:
    """The folder or hub id vLLM loads: where the policy (or a LoRA policy's base) came from. Its
    weights are replaced by the policy's before the first generation; the architecture must match."""
    base = plain_model(model)
    source = getattr(getattr(base, "config", None), "_name_or_path", "")
    if not source:
        raise ModelError("rollout_engine: vllm loads the model from a folder or hub id, and this model was built in "
                         "memory; save it with save_pretrained (tokenizer included) and pass that folder as `model`")
    return resolve_model_path(source)


def llm_kwargs(settings: EngineSettings, model_path: str) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for an engine's settings.

    ``external_launcher`` keeps vLLM's worker in this process, which is what lets ``load_weights``
    reach the model directly; ``processed_logprobs`` makes the returned log-probs those of the
    distribution actually sampled from."""
    return dict(
        model=model_path, dtype=settings.dtype, seed=settings.seed,
        gpu_memory_utilization=settings.gpu_memory_utilization, max_model_len=settings.max_model_len,
        trust_remote_code=settings.trust_remote_code, logprobs_mode="processed_logprobs",
        distributed_executor_backend="external_launcher", enable_prefix_caching=True)


def _single_process_group_env() -> None:
    """The torch.distributed variables ``external_launcher`` reads, for a world of one process
    (left alone when a launcher already set them)."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)


NOT_INSTALLED = f"rollout_engine: vllm needs vLLM, which is not installed; {INSTALL_HINT}"


def check_vllm_installed() -> None:
    """The error ``import_vllm`` would give, without importing vLLM: for the checks before any model loads."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(NOT_INSTALLED)


def import_vllm():
    try:
        import vllm
    except ImportError:
        raise ConfigError(NOT_INSTALLED) from None
    return vllm


class VLLMEngine(OwnWeights):
    """Sampling with a ``vllm.LLM`` in this process; weights pushed with ``push_policy``.

    ``policy``: the training model; its weights are pushed before the first ``generate``, so vLLM
    samples from exactly the policy the trainer holds (a model object, a resumed checkpoint or a
    saved adapter would otherwise be missed). vLLM loads ``model_path``, by default the folder the
    policy came from."""

    name = "vllm"

    def __init__(self, settings: EngineSettings, pad_token_id: int, eos_token_ids: list[int],
                 policy: torch.nn.Module | None = None, model_path: str | None = None):
        vllm = import_vllm()
        model_path = model_path or model_source(policy)
        _single_process_group_env()
        self.llm = vllm.LLM(**llm_kwargs(settings, model_path))
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        self.weight_dtype = settings.dtype
        self.exact_logprobs = False  # other kernels than the trainer's forward: always corrected
        self.unsynced_policy = policy

    @classmethod
    def build(cls, settings: EngineSettings, policy: torch.nn.Module, tokenizer, eos_token_ids: list[int]) -> "VLLMEngine":
        return cls(settings, tokenizer.pad_token_id, eos_token_ids, policy=policy)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 seed: int | None = None) -> Rollout:
        self._push_if_stale()
        from vllm import SamplingParams as VLLMSamplingParams

        kwargs = vllm_sampling_kwargs(params, num_generations, self.eos_token_ids)
        try:
            per_prompt = [VLLMSamplingParams(**kwargs, seed=s) for s in request_seeds(seed, len(prompt_ids))]
        except ValueError as e:
            raise ConfigError(f"vLLM rejects the sampling settings: {e}; adjust temperature, top_p, top_k, min_p "
                              "or repetition_penalty") from None
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], per_prompt, use_tqdm=False)
        return rollout_from_outputs(outputs, num_generations, self.pad_token_id)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load (name, tensor) pairs into vLLM's model, one at a time; returns how many."""
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in weights:
                count += 1
                yield item

        self.llm.apply_model(lambda model: model.load_weights(counted()))
        return count

    def finish_weight_update(self) -> None:
        """Cached prefixes were computed with the old weights: drop them."""
        self.llm.reset_prefix_cache()

    def _push_weights(self, model: torch.nn.Module) -> None:
        self.load_weights(policy_weights(model, tied_copy=True))
        self.finish_weight_update()
