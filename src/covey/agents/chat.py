"""Between an episode's messages and its token ids, through the model's chat template: the prompt with
its tools, and the ids a tool's message adds after a model turn.

Only the ids the environment adds are ever rendered from text; the model's own turns stay the ids it
sampled (token-in, token-out). A tool message's ids are read off the template by rendering a short
conversation with and without it, so they are what the template writes between the end of a model
turn and the opening of the next one, whatever the model wrote in its turn.
"""

from __future__ import annotations

from covey.agents.formats import ToolCallFormat
from covey.data.text import render_chat
from covey.errors import ConfigError

_PROBE = "covey_probe_tool"


def template_renders_tools(tokenizer, template_kwargs: dict | None = None) -> bool:
    """Whether the tokenizer's chat template (with the run's ``template_kwargs``) shows the model the ``tools=``
    it is given (the default model's does not: then the tools go into the system prompt, ``with_tools``)."""
    probe = {"type": "function", "function": {"name": _PROBE, "description": "a probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        text = render_chat(tokenizer, [{"role": "user", "content": "hi"}], True, template_kwargs=template_kwargs,
                           tools=[probe])
    except Exception:  # a template that fails on tools= renders none
        return False
    return _PROBE in text


def with_tools(messages: list[dict], schemas: list[dict], tool_format: ToolCallFormat,
               renders_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(the prompt's messages, the ``tools=`` for its chat template): the template's own rendering where
    it has one, else the format's instructions at the end of the system message (a new one if the
    prompt has none)."""
    if not schemas:
        return messages, None
    if renders_tools:
        return messages, schemas
    text = tool_format.instructions(schemas)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]], None
    return [{"role": "system", "content": text}, *messages], None


def with_reset_text(messages: list[dict], text: str | None) -> list[dict]:
    """The prompt with what an environment's ``reset`` returned appended to its last message, as TRL
    appends it."""
    if not text:
        return messages
    return [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + text}]


def tool_message_ids(tokenizer, tool_messages: list[dict], eos_ids: list[int],
                     template_kwargs: dict | None = None) -> tuple[list[int], int]:
    """(the ids the template writes after a model turn that ended at its end token: the tool messages,
    then the opening of the model's next turn; that end token), rendered with the run's ``template_kwargs``
    (its chat_template_kwargs). Read off a conversation rendered with
    and without the tool messages: what follows the assistant turn's end token in the second (so a
    template that renders a last assistant turn otherwise, as Qwen3's does, is read right too)."""
    call = [{"type": "function", "function": {"name": tool_messages[0].get("name", "tool"), "arguments": {}}}]
    turn = [{"role": "user", "content": "covey"}, {"role": "assistant", "content": "", "tool_calls": call}]

    def ids(messages: list[dict], opened: bool) -> list[int]:
        try:
            text = render_chat(tokenizer, messages, opened, template_kwargs=template_kwargs)
        except Exception as e:  # the template's own error (a missing field it wants, a role it refuses)
            raise ConfigError(f"the chat template cannot render a tool's result after a tool call ({type(e).__name__}: "
                              f"{e}); use a model whose template has a tool role (ChatML, Qwen, Llama 3)") from None
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    before, after = ids(turn, False), ids(turn + tool_messages, True)
    turn_ends = sum(token in eos_ids for token in before)  # the assistant turn's end is the last of them
    ends = [i for i, token in enumerate(after) if token in eos_ids]
    if not turn_ends or len(ends) < turn_ends:
        raise ConfigError("the chat template does not end an assistant turn with the model's end token, so where a "
                          "tool's result begins cannot be told; use a model whose template does (ChatML, Qwen, Llama 3)")
    end = ends[turn_ends - 1]
    return after[end + 1:], after[end]
