"""Finding a reward function from its name: a built-in (covey's, or TRL's under its name),
'path/to/file.py:function' or 'package.module:function'; and the name a run's saved config gives a
function it was handed."""

from __future__ import annotations

import importlib

from covey.errors import RewardError
from covey.rewards.builtin import BUILTIN_REWARD_FACTORIES, BUILTIN_REWARDS
from covey.rewards.convention import RewardFunc, reward_name
from covey.rewards.trl_rewards import TRL_REWARD_FACTORIES, TRL_REWARDS
from covey.sources import in_memory, load_reference, why_unloadable

NAMED_REWARDS: dict[str, RewardFunc] = {**BUILTIN_REWARDS, **TRL_REWARDS}


def load_reward_func(spec: str | RewardFunc, builtin_settings: dict[str, dict] | None = None) -> RewardFunc:
    """A built-in name, 'path/to/file.py:function', 'package.module:function', or a callable.
    ``builtin_settings`` holds the keyword arguments of built-ins that take settings."""
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
    if ":" not in spec:
        names = ", ".join([*NAMED_REWARDS, *BUILTIN_REWARD_FACTORIES])
        raise RewardError(f"reward function {spec!r} is not a built-in ({names}) and not a "
                          "reference; write 'path/to/rewards.py:function' or 'package.module:function'")
    return load_reference(spec, "reward function", RewardError)


def reward_reference(spec: str | RewardFunc) -> str:
    """How ``load_reward_func`` finds this reward again: its name or reference as given, a built-in's
    name, 'package.module:function' for a function of an importable module; else a marker that
    names it and loads nothing (a function defined in a script or notebook)."""
    if isinstance(spec, str):
        return spec
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


# what every reward function receives from the trainer; its other parameters name dataset columns
