"""Finding a reward function from its name: a built-in, 'path/to/file.py:function' or
'package.module:function'; and the name a run's saved config gives a function it was handed."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from covey.errors import RewardError
from covey.rewards.builtin import BUILTIN_REWARD_FACTORIES, BUILTIN_REWARDS
from covey.rewards.convention import RewardFunc, reward_name
from covey.sources import in_memory, why_unloadable


def load_reward_func(spec: str | RewardFunc, builtin_settings: dict[str, dict] | None = None) -> RewardFunc:
    """A built-in name, 'path/to/file.py:function', 'package.module:function', or a callable.
    ``builtin_settings`` holds the keyword arguments of built-ins that take settings."""
    if callable(spec):
        return spec
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if spec in BUILTIN_REWARD_FACTORIES:
        return BUILTIN_REWARD_FACTORIES[spec](**(builtin_settings or {}).get(spec, {}))
    if reason := why_unloadable(spec, "reward_funcs"):
        raise RewardError(reason)
    if ":" not in spec:
        names = ", ".join([*BUILTIN_REWARDS, *BUILTIN_REWARD_FACTORIES])
        raise RewardError(f"reward function {spec!r} is not a built-in ({names}) and not a "
                          "reference; write 'path/to/rewards.py:function' or 'package.module:function'")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        module = _module_from_file(spec, Path(where))
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise RewardError(f"reward function {spec!r}: cannot import module {where!r} ({e})") from e
        except Exception as e:  # the module's own code failed: any exception
            raise RewardError(f"reward function {spec!r}: importing module {where!r} raised {type(e).__name__}: {e}; "
                              "fix the module") from e
    func = getattr(module, name, None)
    if not callable(func):
        raise RewardError(f"reward function {spec!r}: {where} has no function named {name!r}")
    return func


def _module_from_file(spec: str, path: Path) -> Any:
    """The module of ``path``, run with its folder first on sys.path (so that it can import the files
    beside it, as a script can); the folder then moves to the end of sys.path, where a function that
    imports a file beside it when called still finds it, and no installed package is shadowed."""
    if not path.is_file():
        raise RewardError(f"reward function {spec!r}: file {path} does not exist")
    folder = str(path.resolve().parent)
    module_name = f"covey_user_rewards_{abs(hash(str(path.resolve())))}"
    sys.path.insert(0, folder)
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: a syntax error, a missing dependency, any raise
        sys.modules.pop(module_name, None)
        fix = "install the package it imports, or fix the import" if isinstance(e, ImportError) else "fix the file"
        raise RewardError(f"reward function {spec!r}: loading {path} raised {type(e).__name__}: {e}; {fix}") from e
    finally:
        sys.path.remove(folder)
        if folder not in sys.path:
            sys.path.append(folder)
    return module


def reward_reference(spec: str | RewardFunc) -> str:
    """How ``load_reward_func`` finds this reward again: its name or reference as given, a built-in's
    name, 'package.module:function' for a function of an importable module; else a marker that
    names it and loads nothing (a function defined in a script or notebook)."""
    if isinstance(spec, str):
        return spec
    builtin = next((name for name, func in BUILTIN_REWARDS.items() if func is spec), None)
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
