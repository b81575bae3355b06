"""A LoRA policy's weights merged into the plain model's: one tensor at a time for an engine's copy
(``policy_weights``), or into the model itself (``merged_model``)."""

from __future__ import annotations

import collections
import re
from typing import Any, Iterator

import torch

from covey.errors import ModelError
from covey.models.policy import is_peft_model
from covey.models.sharded import parameters_whole

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
