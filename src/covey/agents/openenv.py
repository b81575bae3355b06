"""OpenEnv environments (``pip install 'covey[openenv]'``) in TRL's convention.

``from_openenv(MyEnv)`` turns an OpenEnv ``MCPEnvironment`` class into an environment class for
``environment_factory=``: one OpenEnv environment per episode, created with no arguments; ``reset(**row)``
calls its ``reset`` with the row's columns and returns the observation's ``metadata["prompt"]`` (if
any) for the prompt; each MCP tool it lists becomes a method with the tool's name, arguments and
description (so its schema reads as any tool's), which calls it with ``CallToolAction`` and returns its
text, or an ``error:`` message; ``get_reward`` is the last observation's reward (0 without one).

It runs in this process, the MCP server in memory: no container, no HTTP server. The class it makes
works with TRL's ``environment_factory`` too.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from covey.errors import ConfigError

JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}


def from_openenv(environment: Callable[[], Any], prompt: Callable[[Any], str | None] | None = None) -> type:
    """An environment class in TRL's convention over the OpenEnv environment that ``environment()``
    makes; ``prompt``: the text ``reset`` adds to the prompt, from the observation ``reset`` returned
    (default: its ``metadata["prompt"]``, or nothing)."""
    try:
        from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction
    except ImportError:
        raise ConfigError("from_openenv needs OpenEnv: pip install 'covey[openenv]'") from None
    probe = environment()
    listed = probe.step(ListToolsAction()).tools
    read_prompt = prompt or (lambda observation: (getattr(observation, "metadata", None) or {}).get("prompt"))

    class OpenEnvEnvironment:
        __doc__ = f"OpenEnv's {type(probe).__name__}, one per episode, in TRL's convention (covey.agents.openenv)."

        def __init__(self) -> None:
            self.env, self.reward = environment(), 0.0

        def reset(self, **row: Any) -> str | None:
            observation = self.env.reset(**row)
            self.reward = float(getattr(observation, "reward", None) or 0.0)
            return read_prompt(observation)

        def get_reward(self) -> float:
            return self.reward

        def _call(self, name: str, arguments: dict) -> str:
            observation = self.env.step(CallToolAction(tool_name=name, arguments=arguments))
            if getattr(observation, "reward", None) is not None:
                self.reward = float(observation.reward)
            if observation.error is not None:
                return f"error: {observation.error.message}"
            return "\n".join(part.text for part in observation.result.content if hasattr(part, "text"))

    for tool in listed:
        setattr(OpenEnvEnvironment, tool.name, _method(tool.name, tool.description or tool.name, tool.input_schema))
    OpenEnvEnvironment.__name__ = OpenEnvEnvironment.__qualname__ = type(probe).__name__
    return OpenEnvEnvironment


def _method(name: str, description: str, schema: dict) -> Callable[..., str]:
    """A method that calls the MCP tool ``name``, with a signature, type hints and a docstring read off
    its JSON schema (what ``get_json_schema`` reads)."""
    properties, required = schema.get("properties", {}), set(schema.get("required", []))

    def call(self, **arguments: Any) -> str:
        return self._call(name, arguments)

    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for argument, spec in properties.items():
        parameters.append(inspect.Parameter(argument, inspect.Parameter.KEYWORD_ONLY,
                                            default=inspect.Parameter.empty if argument in required else None,
                                            annotation=JSON_TYPES.get(spec.get("type"), str)))
    call.__signature__ = inspect.Signature(parameters, return_annotation=str)
    call.__annotations__ = {p.name: p.annotation for p in parameters[1:]} | {"return": str}
    lines = [f"        {argument}: {spec.get('description') or spec.get('title') or argument}"
             for argument, spec in properties.items()]
    call.__doc__ = description.strip().splitlines()[0] + ("\n\n    Args:\n" + "\n".join(lines) if lines else "")
    call.__name__ = call.__qualname__ = name
    return call
