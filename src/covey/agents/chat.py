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
from covey.vision import ShownPictures, processed, prompt_images

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
    before, after = (tokenizer(text, add_special_tokens=False)["input_ids"]
                     for text in _rendered(tokenizer, tool_messages, template_kwargs))
    end = _turn_end(before, after, eos_ids)
    return after[end + 1:], after[end]


def tool_message_pictures(processor, tool_messages: list[dict], eos_ids: list[int],
                          template_kwargs: dict | None = None) -> tuple[list[int], int, ShownPictures]:
    """``tool_message_ids`` of tool messages that show pictures (TRL's content parts), through a
    vision-language model's ``processor``: each picture's placeholder expanded to its image tokens; and what
    the pictures are to the model."""
    tokenizer = processor.tokenizer
    without, text = _rendered(processor, tool_messages, template_kwargs)
    before = tokenizer(without, add_special_tokens=False)["input_ids"]
    written = tokenizer(text, add_special_tokens=False)["input_ids"]
    pictures = prompt_images(tool_messages)
    ids, fields, _ = processed(processor, text, pictures, f"the tool {tool_messages[0].get('name', '')}'s picture(s)")
    end, written_end = _turn_end(before, ids, eos_ids), _turn_end(before, written, eos_ids)
    shown = ShownPictures(tuple(pictures), text, tuple(written[written_end + 1:]), tuple(ids[end + 1:]),
                          {key: values[end + 1:] for key, values in fields.items()})
    return ids[end + 1:], ids[end], shown


def _rendered(renderer, tool_messages: list[dict], template_kwargs: dict | None) -> tuple[str, str]:
    """The texts of a short conversation ending with a tool call, without and with ``tool_messages`` after it
    (and the next assistant turn opened), as ``renderer``'s chat template writes them."""
    call = [{"type": "function", "function": {"name": tool_messages[0].get("name", "tool"), "arguments": {}}}]
    turn = [{"role": "user", "content": "covey"}, {"role": "assistant", "content": "", "tool_calls": call}]
    try:
        return (render_chat(renderer, turn, False, template_kwargs=template_kwargs),
                render_chat(renderer, turn + tool_messages, True, template_kwargs=template_kwargs))
    except Exception as e:  # the template's own error (a missing field it wants, a role it refuses)
        raise ConfigError(f"the chat template cannot render a tool's result after a tool call ({type(e).__name__}: "
                          f"{e}); use a model whose template has a tool role (ChatML, Qwen, Llama 3)") from None


def _turn_end(before: list[int], after: list[int], eos_ids: list[int]) -> int:
    """Where the assistant turn of ``before`` ends in ``after`` (the same conversation with more after it)."""
    turn_ends = sum(token in eos_ids for token in before)  # the assistant turn's end is the last of them
    ends = [i for i, token in enumerate(after) if token in eos_ids]
    if not turn_ends or len(ends) < turn_ends:
        raise ConfigError("the chat template does not end an assistant turn with the model's end token, so where a "
                          "tool's result begins cannot be told; use a model whose template does (ChatML, Qwen, Llama 3)")
    return ends[turn_ends - 1]
