"""Episodes: a model that calls tools over several turns, token-in and token-out.

``Agent`` holds what every episode runs with (tools, an environment factory, the tool-call format,
the limits); ``Agent.start`` opens the episodes of one batch, whose ``respond`` the rollout engine
calls each time the model ends a turn:

    the model's turn (the ids it sampled)  ->  parse its tool calls  ->  call the tools
        ->  the ids of the tool messages and of the next turn's opening, appended (never trained)

An episode ends when a turn makes no tool call, when ``max_tool_calling_iterations`` rounds of calls
were made ("cut by the turn limit"), or when the next tool results would not fit in the episode's
``max_completion_length`` tokens, all tokens after the prompt counted ("cut by the length limit";
the results are then not appended, as in TRL). The finish reason is the last turn's: ``eos``,
``stop``, or ``length`` where the budget ran out inside it.

A tool's result may show pictures (TRL's content parts) to a vision-language model: its processor writes the
tool message with each picture's image tokens, and the pictures join the episode's (``prompt_ids``, the ids
of each episode's prompt, carry them: ``covey.vision.images_of``), which every later turn and every log-prob
pass reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from covey.agents.chat import (template_renders_tools, tool_message_ids, tool_message_pictures, with_reset_text,
                               with_tools)
from covey.agents.environments import Environments
from covey.agents.formats import ToolCallFormat
from covey.agents.tools import CallResult, Tool, ToolWorkers, call_tool
from covey.errors import ConfigError
from covey.vision import ImagePromptIds, content_text, images_of, with_pictures_shown


@dataclass
class EpisodeRecord:
    """What one episode did, beside its tokens."""

    messages: list[dict] = field(default_factory=list)  # after the prompt: assistant and tool messages
    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_errors: int = 0  # calls that raised, timed out, returned no text or named no tool
    malformed_calls: int = 0  # tool calls the parser could not read (none was made)
    tool_rounds: int = 0  # turns whose calls were answered
    cut: str | None = None  # "turns" or "length": the episode was stopped with calls unanswered
    consumed: int = 0  # tokens of the episode handed to respond so far (turns and what was appended)

    def stats(self) -> dict[str, Any]:
        return {"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "malformed_calls": self.malformed_calls, "cut": self.cut}


@dataclass(frozen=True)
class Agent:
    """What every episode runs with."""

    tokenizer: Any
    eos_ids: list[int]
    tools: list[Tool]  # the standalone tools (an environment adds its own)
    environment: Environments | None
    tool_format: ToolCallFormat
    max_tool_calling_iterations: int | None  # rounds of tool calls an episode may make (None: no limit)
    tool_timeout: float | None  # seconds one call may take
    renders_tools: bool  # the chat template shows the model its tools=; else the system prompt does
    workers: ToolWorkers | None = None  # the worker process of the tools that need not stay in the trainer's
    chat_template_kwargs: dict | None = None  # the run's, for the chat template that renders tool messages
    processor: Any = None  # a vision-language model's: it writes the prompts that show pictures

    @staticmethod
    def build(tokenizer, eos_ids: list[int], tools: list[Tool], environment: Environments | None,
              tool_format: ToolCallFormat, max_tool_calling_iterations: int | None,
              tool_timeout: float | None, chat_template_kwargs: dict | None = None, processor: Any = None) -> Agent:
        for kind in environment.kinds.values() if environment else [None]:  # the tools one episode sees
            names = [t.name for t in tools] + (kind.tool_names if kind else [])
            if repeated := sorted({n for n in names if names.count(n) > 1}):
                raise ConfigError(f"two tools are both named {repeated[0]!r}: the model could not tell them apart; "
                                  "rename one")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("tools and environments need a model whose tokenizer has a chat template (an "
                              "instruct/chat model): a tool's result is a message of the conversation")
        probe = [{"role": "tool", "name": "probe", "content": "1"}]
        tool_message_ids(tokenizer, probe, eos_ids, chat_template_kwargs)  # fails here, early
        return Agent(tokenizer, eos_ids, tools, environment, tool_format, max_tool_calling_iterations, tool_timeout,
                     template_renders_tools(tokenizer, chat_template_kwargs), ToolWorkers(tools), chat_template_kwargs,
                     processor)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: Any) -> None:
        """The end of a run: its tool worker stops (a later call starts another)."""
        if self.workers is not None:
            self.workers.close()

    def schemas(self, row: dict | None = None) -> list[dict]:
        """The tools shown with the prompt of ``row`` (with several environments, its own environment's;
        without a row, every tool)."""
        return [t.schema for t in self.tools] + (self.environment.schemas(row) if self.environment else [])

    def prompt(self, messages: list[dict], row: dict | None = None) -> tuple[list[dict], list[dict] | None]:
        """(messages, ``tools=``) of ``row``'s prompt with its tools shown to the model."""
        return with_tools(messages, self.schemas(row), self.tool_format, self.renders_tools)

    def start(self, rows: list[dict], indices: list[int]) -> Episodes:
        """The episodes of a batch: one per row (``rows``, the G of a prompt in a row; ``indices``: their
        places in the dataset, for errors), each with its own environment instance where there is one."""
        environments, tools, prompts = [], [], []
        for row, index in zip(rows, indices):
            own, text, instance = [], None, None
            if self.environment is not None:
                instance, text, own = self.environment.start(row, index)
            environments.append(instance)
            tools.append({t.name: t for t in [*self.tools, *own]})
            prompts.append(with_reset_text(row["prompt"], text))
        return Episodes(self, [EpisodeRecord() for _ in rows], environments, tools, prompts)


@dataclass
class Episodes:
    """The episodes of one batch, while they run and after."""

    agent: Agent
    records: list[EpisodeRecord]
    environments: list[Any]  # the instance of each episode (None without an environment)
    tools: list[dict[str, Tool]]  # each episode's tools by name
    prompts: list[list[dict]]  # each episode's prompt messages (with what reset returned)
    # each episode's prompt ids, given before it runs (``begin``); they carry the pictures of the prompt and of
    # the tool messages appended so far
    prompt_ids: list[list[int]] = field(default_factory=list)

    def begin(self, prompt_ids: list[list[int]]) -> None:
        """The episodes' prompts as encoded (one per episode): ``respond`` adds their tools' pictures to them."""
        self.prompt_ids = list(prompt_ids)

    def respond(self, row: int, turn_ids: list[int], room: int) -> list[int] | None:
        """The engine's callback at the end of a model turn (``covey.rollout.engine.Respond``)."""
        agent, record = self.agent, self.records[row]
        text = agent.tokenizer.decode(turn_ids, skip_special_tokens=True)
        parsed = agent.tool_format.parse(text)
        record.turns += 1
        record.malformed_calls += parsed.malformed
        record.consumed += len(turn_ids)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parsed.calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in parsed.calls]
        record.messages.append(message)
        if not parsed.calls:
            return None
        limit = agent.max_tool_calling_iterations
        if limit is not None and record.tool_rounds >= limit:
            record.cut = "turns"
            return None
        results = []
        for call in parsed.calls:
            tool = self.tools[row].get(call.name)
            result = (call_tool(tool, call.arguments, agent.tool_timeout, agent.workers) if tool is not None else
                      CallResult(f"error: there is no tool named {call.name!r}; the tools are "
                                 f"{', '.join(self.tools[row]) or 'none'}", True))
            results.append({"role": "tool", "name": call.name, "content": result.parts or result.text})
            record.tool_calls += 1
            record.tool_errors += result.failed
        shows = [r for r in results if not isinstance(r["content"], str)]
        if shows and agent.processor is None:
            raise ConfigError(f"the tool {shows[0]['name']} returned a picture (an image part among its content parts), "
                              "and the model reads text only: train a vision-language model (with its processor), "
                              "or return text (a description of the picture)")
        if shows:
            appended, end, pictures = tool_message_pictures(agent.processor, results, agent.eos_ids,
                                                            agent.chat_template_kwargs)
        else:
            (appended, end), pictures = tool_message_ids(agent.tokenizer, results, agent.eos_ids,
                                                         agent.chat_template_kwargs), None
        opened = not turn_ids or turn_ids[-1] not in agent.eos_ids  # ended by a stop string: the template's end first
        if opened:
            appended = [end, *appended]
        if len(appended) >= room:
            record.cut = "length"
            return None
        record.messages.extend(results)
        record.tool_rounds += 1
        if pictures is not None:  # the episode's pictures from here on, which ride on what it appends
            start = len(self.prompt_ids[row]) + record.consumed + opened  # where the messages begin in the episode
            images = with_pictures_shown(images_of(self.prompt_ids[row]), agent.processor, pictures, start)
            self.prompt_ids[row] = ImagePromptIds(self.prompt_ids[row], images)
            appended = ImagePromptIds(appended, images)
        record.consumed += len(appended)
        return appended

    def finish(self, completion_ids: list[list[int]]) -> None:
        """After sampling: each episode's last turn where the budget ended it (``respond`` never saw it);
        ``completion_ids``: each episode's ids after its prompt."""
        for record, ids in zip(self.records, completion_ids):
            if len(ids) > record.consumed:
                record.turns += 1
                text = self.agent.tokenizer.decode(ids[record.consumed:], skip_special_tokens=True)
                record.messages.append({"role": "assistant", "content": text})

    def transcript(self, row: int) -> str:
        """The episode as people read it: each turn of the model, and each tool's result after its name."""
        return "\n".join(m["content"] if m["role"] == "assistant" else
                         f"[{m.get('name', 'tool')}] {content_text(m['content'])}" for m in self.records[row].messages)
