"""Tools the model calls during an episode: plain Python functions (TRL's convention), described to the
model by the JSON schema that transformers' ``get_json_schema`` reads from their type hints and
Google-style docstring, and called with a time limit.

A call never crashes the run: a tool that raises, runs past ``tool_timeout`` or returns something
that is not text gives the model an error message as its result, and the failure is counted.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import operator
import threading
from dataclasses import dataclass
from typing import Any, Callable

from covey.errors import ConfigError
from covey.sources import load_reference


@dataclass(frozen=True)
class Tool:
    """A function the model may call, and its JSON schema (``{"type": "function", "function": {...}}``)."""

    name: str
    function: Callable[..., Any]
    schema: dict


def as_tool(function: Callable[..., Any]) -> Tool:
    """``function`` as a tool; a ConfigError naming it where transformers cannot read its schema."""
    from transformers.utils import get_json_schema

    name = getattr(function, "__name__", type(function).__name__)
    try:
        schema = get_json_schema(function)
    except Exception as e:  # transformers raises its own error types for each missing piece
        raise ConfigError(f"tool {name!r}: its JSON schema cannot be read ({e}); a tool needs type hints on every "
                          "argument and a Google-style docstring with a line for each (Args:)") from None
    return Tool(schema["function"]["name"], function, schema)


@dataclass(frozen=True)
class CallResult:
    """What a tool call gave the model, and whether it failed."""

    text: str
    failed: bool


def call_tool(tool: Tool, arguments: dict, timeout: float | None) -> CallResult:
    """Call ``tool`` with ``arguments`` within ``timeout`` seconds (a call past it is left to end in a
    daemon thread); its result as text: a string as it is, a number or a boolean as written, a dict or
    list as JSON. Anything else, an exception or a time-out is an error message for the model."""
    if not isinstance(arguments, dict):
        return CallResult(f"error: the arguments of {tool.name} must be a JSON object, not {arguments!r:.80}", True)
    outcome: list = []

    def call() -> None:
        try:
            value = tool.function(**arguments)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            outcome.append((True, value))
        except BaseException as e:  # the tool's own failure goes back to the model
            outcome.append((False, e))

    thread = threading.Thread(target=call, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        return CallResult(f"error: {tool.name} did not answer within {timeout:g} s", True)
    ok, value = outcome[0]
    if not ok:
        return CallResult(f"error: {tool.name} raised {type(value).__name__}: {value}", True)
    text = result_text(value)
    if text is None:
        return CallResult(f"error: {tool.name} returned a {type(value).__name__}, not text", True)
    return CallResult(text, False)


async def _awaited(value: Any) -> Any:
    return await value


def result_text(value: Any) -> str | None:
    """A tool's result as the text the model reads, or None where it is not text-like."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return str(value)
    if isinstance(value, (dict, list)):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return None
    return None


# ---- built-in tools -------------------------------------------------------------------------------------

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
              ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, for example "47 * 382"
    """
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)[:40]!r}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError:
        raise ValueError(f"cannot read {expression[:60]!r} as arithmetic") from None
    return str(int(result)) if isinstance(result, float) and result.is_integer() else str(result)


def run_python(code: str) -> str:
    """Run a Python program in covey's sandbox and return what it printed.

    Args:
        code: the program; print what you want to see
    """
    from covey.rewards.sandbox import run_python as run_contained

    result = run_contained(code, timeout=5.0, memory_limit_mb=512)
    if result.status != "ok":
        return f"{result.status}: {result.stderr[-400:]}"
    return result.stdout[-2000:]


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculate": calculate, "run_python": run_python}


def load_tool(spec: str | Callable[..., Any]) -> Tool:
    """A tool from a function, a built-in's name (``calculate``, ``run_python``), or a reference
    ('path/to/tools.py:function', 'package.module:function')."""
    if callable(spec):
        return as_tool(spec)
    if spec in BUILTIN_TOOLS:
        return as_tool(BUILTIN_TOOLS[spec])
    if ":" not in spec:
        raise ConfigError(f"tool {spec!r} is not a built-in ({', '.join(BUILTIN_TOOLS)}) and not a reference; write "
                          "'path/to/tools.py:function' or 'package.module:function'")
    return as_tool(load_reference(spec, "tool", ConfigError))
