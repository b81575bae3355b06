"""Agents: episodes of several turns in which the model calls tools, in TRL's conventions (``tools=``,
``environment_factory=``, ``max_tool_calling_iterations``), token-in and token-out.

    tools.py         a tool from a Python function (its JSON schema), calling it safely; the built-ins
    formats.py       how tool calls are written (``hermes`` by default), parsed and rendered
    chat.py          a prompt with its tools; the ids a tool's message adds after a model turn
    environments.py  environment classes (reset, tools as methods, get_reward)
    episodes.py      the episodes of a batch: the engine's ``respond`` at the end of each model turn
"""

from covey.agents.episodes import Agent, EpisodeRecord, Episodes
from covey.agents.formats import FORMATS, HermesFormat, ParsedTurn, ToolCall, ToolCallFormat
from covey.agents.tools import BUILTIN_TOOLS, Tool, as_tool, calculate, call_tool, load_tool

__all__ = ["Agent", "EpisodeRecord", "Episodes", "FORMATS", "HermesFormat", "ParsedTurn", "ToolCall", "ToolCallFormat",
           "BUILTIN_TOOLS", "Tool", "as_tool", "calculate", "call_tool", "load_tool"]
