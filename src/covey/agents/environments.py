"""Environments in TRL's convention (``environment_factory=``): a class created with no arguments, one
instance per episode. ``reset(**row)`` receives the dataset row's columns (``prompt`` among them) and may
return text that is appended to the prompt's last message; the instance's public methods are the model's tools; an
optional ``get_reward()`` scores the finished episode (a reward of weight 1, named after the class).
Reward functions receive the instances as ``environments=[...]``, in the order of the completions.
Several environments in one run (``environment_factory={"name": Class, ...}``, as TRL 1.16) are chosen
row by row by the dataset's ``environment`` column, which ``reset`` does not receive.

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
    cls: type  # the class of its instances
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
        return EnvironmentKind(factory, cls, cls.__name__, names, schemas,
                               callable(getattr(instance, "get_reward", None)))

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
        """``get_reward`` of each episode's instance of this class (None for another class's episodes, in a
        run of several environments), as a reward function named after the class."""
        cls = self.cls

        def reward(environments: list, **_: Any) -> list:
            return [env.get_reward() if type(env) is cls else None for env in environments]

        reward.__name__ = self.name
        return reward


@dataclass(frozen=True)
class Environments:
    """The run's environments: one for every row (under the name None), or several by name, each row
    choosing its own by its ``environment`` column."""

    kinds: dict[str | None, EnvironmentKind]

    @staticmethod
    def probe(factory: Callable[[], Any] | dict[str, Callable[[], Any]]) -> Environments:
        """``environment_factory`` as TRL takes it: a factory, or a dict of named factories."""
        if not isinstance(factory, dict):
            return Environments({None: EnvironmentKind.probe(factory)})
        if not factory:
            raise ConfigError("environment_factory is an empty dict: give {name: EnvironmentClass, ...}, or one class")
        return Environments({str(name): EnvironmentKind.probe(f) for name, f in factory.items()})

    @property
    def several(self) -> bool:
        return None not in self.kinds

    def kind_of(self, row: dict, index: int) -> EnvironmentKind:
        """The environment of the row at ``index``."""
        if not self.several:
            return self.kinds[None]
        name = row.get("environment")
        if name not in self.kinds:
            raise DataError(f"row {index}: environment {name!r} is not among the environments of environment_factory "
                            f"({', '.join(self.kinds)}); each row names its environment in the 'environment' column")
        return self.kinds[name]

    def check_rows(self, rows: list[dict], source: str) -> None:
        """With several environments, every row names a known one (before any model loads)."""
        for i, row in enumerate(rows if self.several else ()):
            if "environment" not in row:
                raise DataError(f"{source}: environment_factory gives several environments ({', '.join(self.kinds)}), "
                                "and the data has no 'environment' column to choose each row's; add one")
            self.kind_of(row, i)

    def start(self, row: dict, index: int) -> tuple[Any, str | None, list[Tool]]:
        """``EnvironmentKind.start`` of the row's environment, which is reset with the row's other columns."""
        columns = {k: v for k, v in row.items() if k != "environment"} if self.several else row
        return self.kind_of(row, index).start(columns, index)

    @property
    def tool_names(self) -> list[str]:
        """Every environment's tools (the same method of two environments once)."""
        return list(dict.fromkeys(name for kind in self.kinds.values() for name in kind.tool_names))

    def schemas(self, row: dict | None = None) -> list[dict]:
        """The tools shown with the row's prompt (its environment's; every environment's without a row)."""
        if row is not None:
            return self.kind_of(row, 0).schemas
        seen = {}
        for kind in self.kinds.values():
            for name, schema in zip(kind.tool_names, kind.schemas):
                seen.setdefault(name, schema)
        return list(seen.values())

    def reward_functions(self) -> list[Callable[..., list]]:
        """One reward function per environment class that defines get_reward (a class named twice once)."""
        classes = {}
        for kind in self.kinds.values():
            if kind.has_reward:
                classes.setdefault(kind.name, kind)
        return [kind.reward_function() for kind in classes.values()]

    def instances_for(self, rows: list[dict]) -> list[Any]:
        """A fresh, unreset instance for each row (what reward functions are first called with)."""
        return [self.kind_of(row, i).factory() for i, row in enumerate(rows)]
