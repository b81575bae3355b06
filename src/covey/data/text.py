"""Between text and token ids: prompt templating and the completion text rewards receive."""

from __future__ import annotations

from typing import Any

import torch

from covey.errors import DataError
from covey.vision import content_text, encode_image_prompt, image_parts


def encode_prompts(tokenizer, prompts: list, max_prompt_length: int, source: str = "dataset",
                   overflow: str = "error", overflowed: list[tuple[int, int]] | None = None,
                   tools: list[list[dict] | None] | None = None,
                   template_kwargs: dict | None = None, processor: Any = None) -> list[list[int] | None]:
    """Token ids per prompt: chat prompts through the model's chat template (with the assistant
    turn opened, the run's ``template_kwargs`` and each prompt's ``tools`` for a template that renders them),
    plain strings as they are. A prompt
    over ``max_prompt_length`` is an error (``overflow="error"``), None (``"drop"``), or keeps its last
    max_prompt_length tokens (``"truncate_left"``); (index, length in tokens) of each such prompt is
    appended to ``overflowed``. Prompts that show pictures are written by the model's ``processor``
    (``encode_image_prompt``): None, a tokenizer's run, cannot encode them."""
    check_chat_template(tokenizer, prompts, source, processor)
    encoded: list[list[int] | None] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif image_parts(prompt):
            shown = None if tools is None else tools[i]
            ids = encode_image_prompt(_processor(processor, source, i), prompt, f"{source}, row {i}",
                                      **(template_kwargs or {}), **({} if shown is None else {"tools": shown}))
        else:
            shown = None if tools is None else tools[i]
            text = render_chat(tokenizer, prompt, True, template_kwargs=template_kwargs,
                               **({} if shown is None else {"tools": shown}))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_length:
            if overflow == "error":
                raise DataError(f"{source}, row {i}: prompt is {len(ids)} tokens, over max_prompt_length="
                                f"{max_prompt_length}; raise max_prompt_length, shorten the prompt, or set "
                                "prompt_overflow: drop | truncate_left")
            if overflow == "truncate_left" and image_parts(prompt):
                raise DataError(f"{source}, row {i}: prompt is {len(ids)} tokens, over max_prompt_length="
                                f"{max_prompt_length}, and shows pictures, whose image tokens cannot be cut: raise "
                                "max_prompt_length, or set prompt_overflow: drop")
            if overflowed is not None:
                overflowed.append((i, len(ids)))
            ids = None if overflow == "drop" else ids[-max_prompt_length:]
        encoded.append(ids)
    return encoded


def _processor(processor, source: str, row: int):
    """The multimodal processor a prompt with pictures is encoded with: the run's, which a tokenizer has not."""
    if processor is None:
        raise DataError(f"{source}, row {row}: the prompt shows pictures, and the model's processing class is a "
                        "tokenizer, which reads text only: give processing_class=AutoProcessor.from_pretrained(...) "
                        "of a vision-language model (or load one by name: its processor comes with it)")
    return processor


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, *,
                template_kwargs: dict | None = None, **kwargs: Any) -> str:
    """``messages`` as the chat template writes them, with ``template_kwargs``, the run's chat_template_kwargs
    (such as Qwen3's enable_thinking): every prompt and tool message is rendered here, each caller passing them."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(template_kwargs or {}), **kwargs)


def check_chat_template(tokenizer, prompts: list, source: str, processor: Any = None) -> None:
    """Chat prompts need a tokenizer (or a processor) with a chat template (a base model's has none)."""
    chat = next((i for i, prompt in enumerate(prompts) if not isinstance(prompt, str)), None)
    if chat is not None and not (getattr(tokenizer, "chat_template", None) or
                                 getattr(processor, "chat_template", None)):
        model = getattr(tokenizer, "name_or_path", "") or "the model"
        raise DataError(f"{source}, row {chat}: the prompts are chats (lists of messages), but the tokenizer of "
                        f"{model} has no chat template (a base model?); give plain-string prompts, or use a model "
                        "whose tokenizer has a chat template (an instruct/chat model)")


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_text(prompt: Any) -> str:
    """What to show of a prompt: the last message of a conversation (the system prompt repeats),
    or the prompt itself."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return content_text(prompt[-1].get("content", ""))
    return str(prompt)


def answer_after_reasoning(text: str) -> str:
    """The part of a completion after its reasoning block.

        "<think>2+2 is 4</think> 4"  -> "4"     (complete block: what follows its last </think>)
        "2+2 is 4</think> 4"         -> "4"     (the chat template opened the block in the prompt)
        "<think>2+2 is"              -> ""      (unterminated: the model never answered)
        "4"                          -> "4"     (no block: the whole text)
    """
    if THINK_CLOSE in text:
        return text.rsplit(THINK_CLOSE, 1)[1].strip()
    return "" if THINK_OPEN in text else text


def decode_completions(tokenizer, completion_ids_BT: torch.Tensor, mask_BT: torch.Tensor,
                       conversational: bool, strip_reasoning: bool = False) -> tuple[list, list[list[int]]]:
    """(completions in the reward format, completion token ids without padding). Special tokens
    (EOS, padding) are removed from the text; with ``strip_reasoning`` only the answer after a
    <think>...</think> block is kept."""
    ids = [row[: int(n)].tolist() for row, n in zip(completion_ids_BT, mask_BT.sum(1))]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    if strip_reasoning:
        texts = [answer_after_reasoning(t) for t in texts]
    if conversational:
        return [[{"role": "assistant", "content": t}] for t in texts], ids
    return texts, ids
