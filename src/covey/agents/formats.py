"""How tool calls are written in the model's text: parsed from its turns, rendered for checks, and
described in the system prompt for chat templates that cannot render tools themselves.

``hermes`` (the default) is the format of Hermes, Qwen2/2.5/3 and SmolLM3's templates:

    <tool_call>
    {"name": "calculate", "arguments": {"expression": "47 * 382"}}
    </tool_call>

Another format is an object with the three methods of ``ToolCallFormat``, handed to the trainer as
``tool_call_format=`` or named in ``FORMATS``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ParsedTurn:
    """The tool calls of one model turn, and how many more it tried to write and got wrong."""

    calls: list[ToolCall] = field(default_factory=list)
    malformed: int = 0


class ToolCallFormat(Protocol):
    def parse(self, text: str) -> ParsedTurn:
        """The tool calls written in a model turn's text."""

    def render(self, call: ToolCall) -> str:
        """A call as the model writes it (``parse(render(call))`` gives it back)."""

    def instructions(self, schemas: list[dict]) -> str:
        """System-prompt text that shows the model these tools and how to call them, for chat templates
        that do not render tools themselves."""


class HermesFormat:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call."""

    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls, malformed = [], 0
        for block in self.BLOCK.finditer(text):
            call = _call_from_json(block.group(1).strip())
            if call is None:
                malformed += 1
            else:
                calls.append(call)
        return ParsedTurn(calls, malformed)

    def render(self, call: ToolCall) -> str:
        return "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.arguments}) + "\n</tool_call>"

    def instructions(self, schemas: list[dict]) -> str:
        listed = "\n".join(json.dumps(schema) for schema in schemas)
        example = self.render(ToolCall("<tool name>", {"<argument>": "<value>"}))
        return ("You can call tools. To call one, write\n" + example + "\nand end your turn; its result comes "
                "back to you in a message from the tool. The tools:\n<tools>\n" + listed + "\n</tools>")


def _call_from_json(text: str) -> ToolCall | None:
    """A call from its JSON object (``arguments`` may be an object or a JSON string of one); None where
    the text is not such an object."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


FORMATS: dict[str, ToolCallFormat] = {"hermes": HermesFormat()}
