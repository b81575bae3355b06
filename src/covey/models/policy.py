"""The policy model's own parts: its LoRA adapter, its output head in float32, its dropout, the plain
model under a PEFT wrapper, its KV cache keyword, and the reference policy for the KL term."""

from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from covey.errors import ConfigError

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
