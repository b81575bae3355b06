"""Environments in TRL's convention (``environment_factory=``): a class created with no arguments, one
instance per episode. ``reset(**row)`` receives the dataset row's columns (``prompt`` among them) and may
return text that is appended to the prompt's last message; the instance's public methods are the model's tools; an
optional ``get_reward()`` scores the finished episode (a reward of weight 1, named after the class).
Reward functions receive the instances as ``environments=[...]``, in the order of the completions.

    class Counter:
        def reset(self, **row):
            self.count = 0
        def add(self, n: int) -> str:
            \"\"\"Add n to the counter.

            Args:
                n: how much to add
            \"\"\"
            self.count += n
            return str(self.count)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from covey.agents.tools import Tool, as_tool
from covey.errors import ConfigError, DataError

NOT_TOOLS = frozenset({"reset", "get_reward"})


@dataclass(frozen=True)
class EnvironmentKind:
    """What one probe instance of a factory shows: the names of its tools and whether it scores episodes."""

    factory: Callable[[], Any]
    name: str  # the class's name: what its reward is logged under
    tool_names: list[str]
    schemas: list[dict]
    has_reward: bool

    @staticmethod
    def probe(factory: Callable[[], Any]) -> EnvironmentKind:
        """Create one instance, as TRL does, to read its tools; a ConfigError says what is missing."""
        try:
            instance = factory()
        except TypeError as e:
            raise ConfigError(f"environment_factory {factory!r} cannot be called with no arguments ({e}): it is "
                              "called once per episode, as TRL calls it") from None
        except Exception as e:  # the user's environment failed to start: say which
            raise ConfigError(f"environment_factory {factory!r} raised {type(e).__name__}: {e} when called with no "
                              "arguments; fix it (it is called once per episode)") from e
        cls = type(instance)
        if not callable(getattr(instance, "reset", None)):
            raise ConfigError(f"environment {cls.__name__} has no reset method: define reset(self, **row), which "
                              "receives the dataset row's columns and may return text for the prompt")
        names = [name for name, _ in inspect.getmembers(cls, inspect.isfunction)
                 if not name.startswith("_") and name not in NOT_TOOLS]
        schemas = [as_tool(getattr(instance, name)).schema for name in names]
        return EnvironmentKind(factory, cls.__name__, names, schemas, callable(getattr(instance, "get_reward", None)))

    def start(self, row: dict, index: int) -> tuple[Any, str | None, list[Tool]]:
        """A new instance for an episode of the row at ``index``: (it, what its reset returned, its tools)."""
        instance = self.factory()
        try:
            text = instance.reset(**row)  # every column, the prompt too, as TRL passes them
        except Exception as e:  # the user's environment: whatever it raises names the row
            raise DataError(f"environment {self.name}: reset raised {type(e).__name__}: {e} on row {index} "
                            f"(columns {', '.join(row)}); fix reset or the row") from e
        if text is not None and not isinstance(text, str):
            raise DataError(f"environment {self.name}: reset returned a {type(text).__name__} on row {index}; it "
                            "returns None or text to add to the prompt")
        tools = [Tool(name, getattr(instance, name), schema) for name, schema in zip(self.tool_names, self.schemas)]
        return instance, text, tools

    def reward_function(self) -> Callable[..., list]:
        """``get_reward`` of each episode's instance, as a reward function named after the class."""
        def reward(environments: list, **_: Any) -> list:
            return [env.get_reward() for env in environments]

        reward.__name__ = self.name
        return reward
