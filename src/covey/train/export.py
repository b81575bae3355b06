"""A trained policy as a plain Hugging Face model, for use without covey or PEFT.

``covey export SOURCE OUT`` writes OUT, a folder that ``transformers.pipeline("text-generation",
model=OUT)`` and ``AutoModelForCausalLM.from_pretrained(OUT)`` load: the weights, the config and
the tokenizer; for a vision-language model also its processor and chat template, so that
``AutoModelForImageTextToText`` and ``AutoProcessor`` load it. A LoRA adapter is merged into its
base weights (``merged_model``): the same W + scale * B @ A that covey's rollout engines sample
with. SOURCE is a run folder (its ``final_model/``), a checkpoint folder (its ``model/``), or any
model covey loads (a folder, a saved adapter, a hub id). OUT must not exist: nothing is
overwritten, and it appears whole or not at all.

    covey export runs/gsm8k exported/gsm8k
    covey export runs/gsm8k/checkpoints/checkpoint-200 exported/step-200 --dtype bfloat16
"""

from __future__ import annotations

from pathlib import Path

import torch

from covey.errors import ConfigError, ModelError
from covey.models import (ModelLoading, is_peft_model, load_policy, load_processing, merged_model, quiet_transformers,
                          tokenizer_as_loaded)
from covey.train.checkpoint import written_whole
from covey.vision import is_vision_model
from covey.vision.models import save_processor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_source(source: str) -> str:
    """The model that ``source`` names: a run folder's final model, a checkpoint's model, else itself."""
    path = Path(source).expanduser()
    if (path / "state.json").is_file() and (path / "model").is_dir():  # a checkpoint
        return str(path / "model")
    if (path / "final_model").is_dir():
        return str(path / "final_model")
    if (path / "metrics.jsonl").is_file():  # a run folder without its final model
        raise ConfigError(f"{path} is a run folder without final_model/ (the run has not finished); export one of its "
                          f"checkpoints instead, e.g. covey export {path / 'checkpoints' / 'checkpoint-<step>'} OUT")
    return source


def export_model(source: str, out: str | Path, dtype: str = "float32", trust_remote_code: bool = False) -> Path:
    """Write ``source`` (see the module's docstring) to the new folder ``out`` as a plain model with its
    tokenizer (and processor), in ``dtype`` (a key of ``DTYPES``); the folder written."""
    out = Path(out).expanduser()
    if out.exists():
        raise ConfigError(f"{out} already exists; covey export writes a new folder and overwrites nothing: "
                          "choose another OUT, or remove that one first")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not out.parent.is_dir():
        raise ConfigError(f"{out.parent} is not a folder: create it first (OUT is written inside it)")
    name = model_source(source)
    quiet_transformers()
    model = load_policy(name, ModelLoading(trust_remote_code))
    folder = Path(name).expanduser()
    has_tokenizer = not folder.is_dir() or (folder / "tokenizer_config.json").is_file()
    tokenizer, processor = load_processing(name if has_tokenizer else _base_model(model, name), trust_remote_code)
    if processor is None and is_vision_model(model) and is_peft_model(model):  # an adapter saved without it
        processor = load_processing(_base_model(model, name), trust_remote_code)[1]
    plain = merged_model(model).to(DTYPES[dtype]).eval()
    with written_whole(out, f"{out.name}-*") as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        save_processor(processor, tmp)  # a vision-language model's, with its chat template, before its tokenizer
        with tokenizer_as_loaded(tokenizer) as as_loaded:
            as_loaded.save_pretrained(tmp)
    return out


def _base_model(model: torch.nn.Module, name: str) -> str:
    """Where a saved adapter without a tokenizer (or processor) of its own finds one: its base model."""
    if is_peft_model(model):
        return model.peft_config[model.active_adapter].base_model_name_or_path
    raise ModelError(f"{name} has no tokenizer (tokenizer_config.json); save the model's tokenizer beside it")
