"""Tools the model calls during an episode: plain Python functions (TRL's convention), described to the
model by the JSON schema that transformers' ``get_json_schema`` reads from their type hints and
Google-style docstring, and called with a time limit.

A failing call never crashes the run: a tool that raises, runs past ``tool_timeout`` or returns
something that is not text gives the model an error message as its result, and the failure is counted.
A result may be content parts (TRL's form of a message): text parts alone read as their texts; with
pictures among them (``{"type": "image", "image": <PIL image or path>}``) the parts are the tool
message's content, which a vision-language model's processor writes with the pictures expanded.

A run's own tools (not an environment's) are called in a worker process forked for them
(``ToolWorkers``), which is killed, with every process the tool started, when a call runs past
``tool_timeout``, and replaced for the next call (counted as ``tools/stopped``). A tool that must share
the trainer's memory (it reads or changes the trainer's objects) is marked
``in_trainer_process = True``: it runs in the trainer's process, and a call past the limit can only
be abandoned in a thread that runs on (counted as ``tools/abandoned``). An environment's tools are
methods of the episode's environment, whose state they change: they run in the trainer's process too.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

from covey.errors import ConfigError
from covey.rewards.pool import RewardPool
from covey.rewards.stoppable import WorkerFault, call_in_thread, can_fork, stays_in_process
from covey.sources import load_reference
from covey.vision.rows import IMAGE_KEYS, content_text, open_image


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

    text: str  # what the model was told (a picture as its label)
    failed: bool
    parts: list[dict] | None = None  # a result that shows pictures: its content parts, each picture opened


class ToolWorkers:
    """A worker process for the tools that may leave the trainer's process: forked at once (before
    the trainer runs threads of its own), killed and replaced when a call runs past its limit."""

    def __init__(self, tools: Sequence[Tool]):
        self._calls = {id(t.function): synchronous(t.function) for t in tools if not stays_in_process(t.function)}
        # a call whose worker ended under it is not run again: a tool may act on the world (the model reads the error)
        self._pool = RewardPool(list(self._calls.values()), 1 if self._calls and can_fork() else 0, kind="tools",
                                retry_lost=False)
        self._lock = threading.Lock()  # one call at a time: the worker answers them in turn
        self._pool.start()

    def runs(self, tool: Tool) -> bool:
        return self._pool.num_workers > 0 and id(tool.function) in self._calls

    def call(self, tool: Tool, arguments: dict, timeout: float | None) -> Any:
        """The tool's value; a raise, a death or a time-out as the exception that stands for it."""
        with self._lock:
            outcome = self._pool.run([(self._calls[id(tool.function)], arguments)], timeout)[0]
            self._pool.start()  # a worker killed by the call is replaced now, not during the next
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def close(self) -> None:
        self._pool.close()


def synchronous(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, whose value is awaited when it is awaitable (an ``async def`` tool)."""
    def call(**arguments: Any) -> Any:
        value = function(**arguments)
        return asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value
    return call


def call_tool(tool: Tool, arguments: dict, timeout: float | None, workers: ToolWorkers | None = None) -> CallResult:
    """Call ``tool`` with ``arguments`` within ``timeout`` seconds: in ``workers`` where it runs there
    (a call past the limit is stopped), else in a daemon thread of this process (a call past it is
    abandoned). Its result as text: a string as it is, a number or a boolean as written, a dict or
    list as JSON. Anything else, an exception or a time-out is an error message for the model."""
    if not isinstance(arguments, dict):
        return CallResult(f"error: the arguments of {tool.name} must be a JSON object, not {arguments!r:.80}", True)
    try:
        if workers is not None and workers.runs(tool):
            value = workers.call(tool, arguments, timeout)
        elif timeout is None:
            value = synchronous(tool.function)(**arguments)
        else:
            value = call_in_thread(synchronous(tool.function), arguments, timeout, "tools", f"tool-{tool.name}")
    except TimeoutError:
        return CallResult(f"error: {tool.name} did not answer within {timeout:g} s", True)
    except WorkerFault as e:  # worded in the worker: "raised ValueError: ...", "ended its worker process (...)"
        return CallResult(f"error: {tool.name} {e}", True)
    except (Exception, SystemExit) as e:  # the tool's own failure goes back to the model
        return CallResult(f"error: {tool.name} raised {type(e).__name__}: {e}", True)
    if shows_pictures(value):
        parts = opened_parts(value, f"the tool {tool.name}'s result")
        return CallResult(content_text(parts), False, parts)
    text = result_text(value)
    if text is None:
        return CallResult(f"error: {tool.name} returned a {type(value).__name__}, not text", True)
    return CallResult(text, False)


async def _awaited(value: Any) -> Any:
    return await value


# the kinds of content part (TRL's convention for a tool's message given as a list of parts) that show a picture
PICTURE_PARTS = ("image", "image_url")


def content_parts(value: Any) -> list[dict] | None:
    """``value`` as TRL's content parts of a message (a list of ``{"type": "text", "text": ...}`` and
    ``{"type": "image", "image": ...}``), None where it is not one."""
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(p, dict) and (p.get("type") in PICTURE_PARTS or
                                    p.get("type") == "text" and isinstance(p.get("text"), str)) for p in value):
        return value
    return None


def shows_pictures(value: Any) -> bool:
    """Whether a tool's result is content parts that show a picture."""
    return any(part["type"] in PICTURE_PARTS for part in content_parts(value) or ())


def opened_parts(parts: list[dict], where: str) -> list[dict]:
    """Content parts that show pictures, each picture opened (a PIL image, or a file's path); an ``image_url``
    part is refused (covey fetches nothing)."""
    out = []
    for part in parts:
        if part["type"] == "image_url":
            raise ConfigError(f"{where}: an image_url part ({str(part)[:80]}); give the picture itself, "
                              "{'type': 'image', 'image': <PIL image or path to a file>}")
        if part["type"] == "image":
            given = next((part[key] for key in IMAGE_KEYS if part.get(key) is not None), None)
            part = {"type": "image", "image": open_image(given, where)}
        out.append(part)
    return out


def result_text(value: Any) -> str | None:
    """A tool's result as the text the model reads, or None where it is not text-like: content parts of text
    alone read as their texts, one after the other (as a chat template writes them)."""
    if isinstance(value, str):
        return value
    if (parts := content_parts(value)) is not None and not shows_pictures(parts):
        return "".join(part["text"] for part in parts)
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
