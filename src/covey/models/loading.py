"""Loading the policy and its tokenizer from a folder, a hub id or the embedded model, and preparing
the tokenizer for generation."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from covey.errors import ConfigError, ModelError
from covey.models.device import default_device
from covey.models.embedded import resolve_model_path
from covey.models.verbosity import quiet_transformers
from covey.sources import why_unloadable
from covey.vision.models import is_vision_source, load_processor, load_vision_model

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


# what a BitsAndBytesConfig handed to the trainer (TRL's quantization_config) may say beyond covey's fields: its
# values here, at which covey loads the model alike (its compute dtype is the model's dtype, as TRL's scripts set it)
BNB_AS_COVEY_LOADS = {"llm_int8_threshold": 6.0, "llm_int8_skip_modules": None, "llm_int8_enable_fp32_cpu_offload": False,
                      "llm_int8_has_fp16_weight": False}


def quantization_settings(quantization_config: Any, dtype: str) -> dict[str, Any]:
    """TRL's ``quantization_config`` (a transformers ``BitsAndBytesConfig``, or None) as covey's config fields
    (load_in_4bit, load_in_8bit, bnb_4bit_quant_type, use_bnb_nested_quant); a setting covey would not load
    the model with is refused, each named."""
    if quantization_config is None:
        return {}
    if not hasattr(quantization_config, "load_in_4bit"):
        raise ConfigError(f"quantization_config must be a transformers BitsAndBytesConfig (or None), not "
                          f"{type(quantization_config).__name__}; give BitsAndBytesConfig(load_in_4bit=True, ...)")
    q = quantization_config
    problems = [f"quantization_config.{name}={getattr(q, name)!r} (covey loads with {value!r})"
                for name, value in BNB_AS_COVEY_LOADS.items() if getattr(q, name, value) != value]
    compute = q.bnb_4bit_compute_dtype
    if q.load_in_4bit and compute is not None and str(compute).removeprefix("torch.") not in (dtype, "float32"):
        problems.append(f"quantization_config.bnb_4bit_compute_dtype={compute} (covey computes in the model's "
                        f"dtype, {dtype}: set dtype to it)")
    if problems:
        raise ConfigError("the quantization_config handed to the trainer says what covey cannot honour: "
                          + "; ".join(problems) + "; give load_in_4bit / load_in_8bit and the bnb settings covey takes")
    return {"load_in_4bit": bool(q.load_in_4bit), "load_in_8bit": bool(q.load_in_8bit),
            "bnb_4bit_quant_type": q.bnb_4bit_quant_type, "use_bnb_nested_quant": bool(q.bnb_4bit_use_double_quant)}


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
    """The model's tokenizer, prepared for generation (a vision-language model's: its processor's)."""
    return load_processing(name_or_path, trust_remote_code, revision)[0]


def load_processing(name_or_path: str, trust_remote_code: bool = False, revision: str = "main",
                    pictures: bool = False) -> tuple[Any, Any]:
    """(tokenizer, processor) of a model: a vision-language model's processor (which encodes prompts with
    pictures) and its tokenizer, prepared for generation; for another model its tokenizer and None.
    ``pictures``: the prompts show some, and a vision-language model's processor that does not load is an error."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    processor = load_processor(path, trust_remote_code, revision, needed=pictures)
    try:
        tokenizer = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code, **({} if revision == "main" else {"revision": revision}))
    except (OSError, ValueError) as e:
        raise _not_loaded(name_or_path, e) from e
    prepare_tokenizer(tokenizer)
    return tokenizer, processor


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
            model = _adapter_on_base(path, kwargs)
        elif is_vision_source(path, loading.revision):  # as AutoModelForImageTextToText loads it
            model = load_vision_model(path, kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, TypeError) as e:  # TypeError: a model_init_kwargs key the model does not take
        raise _not_loaded(name_or_path, e) from e
    return model if loading.quantization else model.to(default_device(loading.use_cpu))


def _adapter_on_base(path: str, kwargs: dict[str, Any]):
    """A saved LoRA adapter on its base model, trainable as a policy is (training goes on from it); a
    vision-language base loaded as ``AutoModelForImageTextToText`` loads it."""
    from peft import AutoPeftModelForCausalLM, PeftConfig, PeftModel

    base = PeftConfig.from_pretrained(path).base_model_name_or_path
    if base and is_vision_source(resolve_model_path(base)):
        return PeftModel.from_pretrained(load_vision_model(base, kwargs), path, is_trainable=True)
    return AutoPeftModelForCausalLM.from_pretrained(path, is_trainable=True, **kwargs)


def _not_loaded(name_or_path: str, e: Exception) -> ModelError:
    if reason := why_unloadable(name_or_path, "model"):
        return ModelError(reason)
    path = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1
    why = f"there is no folder {path}" if looks_local and not path.exists() else str(e).strip().rstrip(".")
    return ModelError(f"could not load model {name_or_path!r}: {why}. Pass a hub id, a local folder with "
                      "config.json and weights, or leave `model` at its default (the embedded model)")
