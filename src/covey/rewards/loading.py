"""Finding a reward function from its name: a built-in (covey's, or TRL's under its name),
'path/to/file.py:function', 'package.module:function', or a reward model's hub id or folder; and the
name a run's saved config gives a function it was handed."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import torch

from covey.errors import RewardError
from covey.rewards import symbolic
from covey.rewards.builtin import BUILTIN_REWARD_FACTORIES, BUILTIN_REWARDS
from covey.rewards.convention import RewardFunc, reward_name
from covey.rewards.reward_model import RewardModel, load_reward_model, reward_model_from_object
from covey.rewards.trl_rewards import TRL_REWARD_FACTORIES, TRL_REWARDS
from covey.sources import in_memory, load_reference, why_unloadable

NAMED_REWARDS: dict[str, RewardFunc] = {**BUILTIN_REWARDS, **TRL_REWARDS}
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def load_reward_func(spec: str | RewardFunc | torch.nn.Module, builtin_settings: dict[str, dict] | None = None,
                     processing_class: Any = None, trust_remote_code: bool = False,
                     device: torch.device | str | None = None) -> RewardFunc:
    """A built-in name, 'path/to/file.py:function', 'package.module:function', a reward model (hub id,
    folder or loaded sequence classifier), or a callable. ``builtin_settings`` holds the keyword
    arguments of built-ins that take settings; ``processing_class``, a reward model's tokenizer (None:
    its own); ``device``, where a reward model given by name goes."""
    func = _found(spec, builtin_settings, processing_class, trust_remote_code, device)
    if getattr(func, "needs_math_verify", False):
        symbolic.require(reward_name(func))
    return func


def _found(spec: str | RewardFunc | torch.nn.Module, builtin_settings: dict[str, dict] | None, processing_class: Any,
           trust_remote_code: bool, device: torch.device | str | None) -> RewardFunc:
    if isinstance(spec, torch.nn.Module):  # before callable(): a model is callable too
        return reward_model_from_object(spec, processing_class, trust_remote_code)
    if processing_class is not None and not _names_a_model(spec):
        what = "has its tokenizer already" if isinstance(spec, RewardModel) else "is not a reward model"
        raise RewardError(f"reward_processing_classes gives a tokenizer for {_shown(spec)}, which {what}; put None "
                          "in its place")
    if callable(spec):
        return spec
    if spec in NAMED_REWARDS:
        return NAMED_REWARDS[spec]
    if spec in BUILTIN_REWARD_FACTORIES:
        return BUILTIN_REWARD_FACTORIES[spec](**(builtin_settings or {}).get(spec, {}))
    if spec in TRL_REWARD_FACTORIES:
        alternative = (" or the built-in soft_overlong_penalty, set by overlong_max_length and overlong_cache_length"
                       if spec == "get_soft_overlong_punishment" else "")
        raise RewardError(f"{spec!r} makes a reward function from settings, so it cannot be named alone: call it in "
                          f"Python (from covey.rewards import {spec}; reward_funcs=[{spec}(...)]), reference a "
                          f"module-level function made with it ('my_rewards.py:my_reward'){alternative}")
    if reason := why_unloadable(spec, "reward_funcs"):
        raise RewardError(reason)
    if ":" in spec:
        return load_reference(spec, "reward function", RewardError)
    if _names_a_model(spec):
        return load_reward_model(spec, processing_class, trust_remote_code, device)
    names = ", ".join([*NAMED_REWARDS, *BUILTIN_REWARD_FACTORIES])
    raise RewardError(f"reward function {spec!r} is not a built-in ({names}), not a reference ('path/to/rewards.py:"
                      "function' or 'package.module:function'), and not a reward model (a hub id 'org/name', or a "
                      f"folder: there is none at {Path(spec).expanduser()})")


def _names_a_model(spec: Any) -> bool:
    """Whether ``spec`` reads as a reward model: an existing folder, or a hub id ('org/name')."""
    if not isinstance(spec, str) or ":" in spec or spec.endswith(".py"):
        return False
    return Path(spec).expanduser().is_dir() or HUB_ID.fullmatch(spec) is not None


def _shown(spec: Any) -> str:
    return repr(spec) if isinstance(spec, str) else f"reward function {reward_name(spec)!r}"


def reward_reference(spec: str | RewardFunc | torch.nn.Module) -> str:
    """How ``load_reward_func`` finds this reward again: its name or reference as given, a built-in's
    name, a reward model's hub id or folder, 'package.module:function' for a function of an importable
    module; else a marker that names it and loads nothing (a function defined in a script or notebook,
    a model object)."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, RewardModel) and spec.reference:
        return spec.reference
    if isinstance(spec, (RewardModel, torch.nn.Module)):
        model = spec.model if isinstance(spec, RewardModel) else spec
        origin = getattr(getattr(model, "config", None), "_name_or_path", None)
        return in_memory(f"reward model {type(model).__name__}{f' from {origin}' if origin else ''}")
    builtin = next((name for name, func in NAMED_REWARDS.items() if func is spec), None)
    module, qualname = getattr(spec, "__module__", None), getattr(spec, "__qualname__", "")
    if builtin is None and module and module != "__main__" and "<" not in qualname:
        try:
            found = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
        if found is spec:
            return f"{module}:{qualname}"
    return builtin or in_memory(f"function {reward_name(spec)}")
