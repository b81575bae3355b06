"""Vision-language models: telling them apart, loading them with their processors, and which of their
parts train.

A vision-language model (transformers' ``AutoModelForImageTextToText``: Qwen2-VL, Qwen2.5-VL, Idefics3 and
SmolVLM, LLaVA, Gemma 3...) is a language model that reads image features beside its token embeddings:
a vision tower turns pixels into features and a projector maps them into the language model's space.
covey trains the language model; the vision tower and projector stay frozen unless ``train_vision_tower``
asks otherwise (LoRA adapters then go on them too, or their full weights train).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from covey.errors import ConfigError, warn


def is_vision_config(config: Any) -> bool:
    """Whether a model config (an object or config.json's dict) is a vision-language model's."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    return get("vision_config", None) is not None


def is_vision_source(path: str, revision: str = "main") -> bool:
    """Whether a model folder or hub id holds a vision-language model (its config.json has a vision config);
    a hub id's config.json is read as transformers reads it (from the local cache, else downloaded)."""
    config = Path(path).expanduser() / "config.json"
    try:
        if not config.is_file():
            if Path(path).expanduser().exists():  # a folder without config.json (a saved adapter)
                return False
            from huggingface_hub import hf_hub_download

            config = Path(hf_hub_download(path, "config.json", revision=None if revision == "main" else revision))
        return is_vision_config(json.loads(config.read_text()))
    except (OSError, ValueError):  # no such model or file, offline without it cached: the loading says so
        return False


def is_vision_model(model: Any) -> bool:
    return is_vision_config(getattr(model, "config", None) or {})


def load_vision_model(path: str, kwargs: dict[str, Any]):
    """A vision-language model, as TRL's scripts load one (``AutoModelForImageTextToText``)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, **kwargs)


def is_processor(processing_class: Any) -> bool:
    """Whether a processing class is a multimodal processor (a tokenizer with an image processor beside)."""
    return hasattr(processing_class, "tokenizer") and hasattr(processing_class, "image_processor")


def text_tokenizer(processing_class: Any) -> Any:
    """The tokenizer every text stage of a run uses: a processor's own, or the processing class itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class


def processor_of(processing_class: Any) -> Any | None:
    """The multimodal processor a run encodes prompts with pictures with (None: a tokenizer, text only)."""
    return processing_class if is_processor(processing_class) else None


def load_processor(path: str, trust_remote_code: bool = False, revision: str = "main", needed: bool = False
                   ) -> Any | None:
    """The processor of a vision-language model's folder or hub id (or of a folder a processor was saved in:
    a LoRA adapter of such a model); None for a model that is not one, or whose processor does not load (its
    tokenizer alone is then used, for prompts of text). ``needed`` (the prompts show pictures): a vision-language
    model's processor that does not load is an error saying why, raised before the model loads."""
    if not is_vision_source(path, revision) and not (Path(path) / "processor_config.json").is_file():
        return None
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                  **({} if revision == "main" else {"revision": revision}))
    except (OSError, ValueError, ImportError) as e:
        if needed:
            raise ConfigError(_unloadable_processor(path, e)) from None
        return None
    return processor if is_processor(processor) else None


def _unloadable_processor(path: str, e: Exception) -> str:
    why = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    fix = ("install what it names (the video part of the Qwen-VL processors needs torchvision: pip install "
           "torchvision)" if isinstance(e, ImportError) else
           "save the model's processor in its folder (processor.save_pretrained)")
    return (f"the training prompts show pictures, and the processor of {path} does not load ({why}): {fix}, or "
            "give the processor as processing_class")


def save_processor(processor: Any | None, folder: Any) -> None:
    """A run's processor (a vision-language model's; None: nothing to save) saved in ``folder`` beside the
    model so that ``AutoProcessor`` loads it from there; a processor that cannot be saved is warned of."""
    if processor is None:
        return
    try:
        processor.save_pretrained(folder)
    except (AttributeError, TypeError, ValueError, OSError) as e:
        warn(f"the model's processor ({type(processor).__name__}) could not be saved with it ({e}); save it "
                      "yourself beside the model (processor.save_pretrained)", stacklevel=2)


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The model without its output head: the module that takes ids and pixels and returns the language
    model's last hidden states (``model.model`` for transformers' vision-language models)."""
    return getattr(model, model.base_model_prefix)


def vision_parts(model: torch.nn.Module) -> list[str]:
    """The qualified names of a vision-language model's parts that are not its language model or head: the
    vision tower and the projector (the backbone's children other than its decoder)."""
    inner = backbone(model)
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is inner)
    return [f"{prefix}.{name}" if prefix else name for name, child in inner.named_children() if child is not decoder]


def freeze_vision_parts(model: torch.nn.Module) -> int:
    """The vision tower and projector no longer train; the number of parameters frozen."""
    frozen = 0
    names = tuple(f"{name}." for name in vision_parts(model))
    for name, param in model.named_parameters():
        if name.startswith(names) and param.requires_grad:
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def lora_exclusion(model: torch.nn.Module) -> str:
    """peft's ``exclude_modules`` (a regular expression over module names) that keeps LoRA adapters off the
    vision tower and projector."""
    return "|".join(rf"{re.escape(name)}(\..*)?" for name in vision_parts(model))


def vision_lora_options(model: torch.nn.Module, train_vision_tower: bool) -> dict[str, Any]:
    """covey's own LoRA adapter (``add_lora``'s further options) on a vision-language model: none on the vision
    tower and projector unless ``train_vision_tower``."""
    if not is_vision_model(model) or train_vision_tower:
        return {}
    return {"exclude_modules": lora_exclusion(model)}


def check_vision_settings(model: Any, train_vision_tower: bool) -> None:
    """train_vision_tower is for vision-language models only."""
    if train_vision_tower and model is not None and not isinstance(model, str) and not is_vision_model(model):
        raise ConfigError("train_vision_tower: true trains a vision-language model's vision tower, and this model has "
                          "none; remove it")
