"""Between text and token ids: prompt templating and the completion text rewards receive."""

from __future__ import annotations

import torch

from covey.errors import DataError


def encode_prompts(tokenizer, prompts: list, max_prompt_length: int, source: str = "dataset") -> list[list[int]]:
    """Token ids per prompt: chat prompts through the model's chat template (with the assistant
    turn opened), plain strings as they are. A prompt over ``max_prompt_length`` is an error."""
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_length:
            raise DataError(f"{source}, row {i}: prompt is {len(ids)} tokens, over max_prompt_length="
                                f"{max_prompt_length}; raise max_prompt_length or shorten the prompt")
        encoded.append(ids)
    return encoded


def decode_completions(tokenizer, completion_ids_BT: torch.Tensor, mask_BT: torch.Tensor,
                       conversational: bool) -> tuple[list, list[list[int]]]:
    """(completions in the reward format, completion token ids without padding)."""
    ids = [row[: int(n)].tolist() for row, n in zip(completion_ids_BT, mask_BT.sum(1))]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    if conversational:
        return [[{"role": "assistant", "content": t}] for t in texts], ids
    return texts, ids
