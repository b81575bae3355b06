"""A prompt's pictures as the model takes them, from encoding to every pass that reads the prompt.

The model's processor writes a prompt with pictures: its chat template puts each picture's placeholder,
the processor expands it to as many image tokens as the picture gives features, and returns the pixel
tensors the vision tower reads (``pixel_values``, and per family ``image_grid_thw``,
``pixel_attention_mask``, ``image_sizes``...) and fields that go token by token with the ids
(``mm_token_type_ids``, ``token_type_ids``). ``encode_image_prompt`` keeps all of them with the prompt's
ids (``ImagePromptIds``, a list of ids that carries its ``PromptImages``), so that sampling and every
log-prob pass (training, old policy, reference) hand the model the very same inputs:
``model_inputs`` puts those of a batch's rows together.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from covey.errors import DataError, ModelError
from covey.vision.rows import image_label, prompt_images


@dataclass(frozen=True, eq=False)
class PromptImages:
    """What one prompt's pictures are to the model, as its processor gave them."""

    tensors: dict[str, torch.Tensor]  # pixel tensors and their shapes, first dimension over pictures or patches
    token_fields: dict[str, torch.Tensor]  # (P,) fields that go with each prompt token
    pictures: tuple  # the PIL images, in order (what an engine with its own processor, vLLM, is given)
    labels: tuple[str, ...]  # each picture's label (``image_label``)
    # the prompt as the chat template wrote it, each picture one placeholder (what vLLM expands itself), and
    # the length of the processor's expansion of it (the ids after it are an episode's later tokens)
    template_ids: tuple[int, ...] = ()
    expanded_length: int = 0

    def unexpanded(self, ids: list[int]) -> list[int]:
        """``ids`` (this prompt, expanded, and what followed it) with the prompt as the chat template wrote it."""
        return [*self.template_ids, *ids[self.expanded_length:]]

    @property
    def count(self) -> int:
        return len(self.pictures)


class ImagePromptIds(list):
    """A prompt's token ids (a list, as every prompt's) that carry the prompt's ``PromptImages``."""

    def __init__(self, ids: list[int], images: PromptImages):
        super().__init__(ids)
        self.images = images

    def __reduce__(self):  # pickled whole (to worker processes), pictures included
        return ImagePromptIds, (list(self), self.images)


def images_of(prompt_ids: Any) -> PromptImages | None:
    """The pictures a prompt's ids carry (None: a prompt without any)."""
    return getattr(prompt_ids, "images", None)


def with_images_of(prompt_ids: Any, ids: list[int]) -> list[int]:
    """``ids`` (a prompt continued: the episode so far) carrying ``prompt_ids``' pictures, if any."""
    images = images_of(prompt_ids)
    return ids if images is None else ImagePromptIds(ids, images)


def encode_image_prompt(processor: Any, messages: list[dict], where: str, **template_kwargs: Any) -> ImagePromptIds:
    """A chat prompt with pictures through the model's processor: the chat template (assistant turn opened,
    ``template_kwargs`` such as tools) with each image placeholder expanded to the picture's image tokens."""
    pictures = prompt_images(messages)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    try:
        out = processor(text=[text], images=[pictures], add_special_tokens=False, return_tensors="pt")
    except (ValueError, TypeError) as e:
        raise DataError(f"{where}: the model's processor cannot take this prompt with its {len(pictures)} "
                        f"picture(s): {e}") from None
    ids = out["input_ids"][0]
    token_fields, tensors = {}, {}
    for key, value in out.items():
        if key in ("input_ids", "attention_mask") or not isinstance(value, torch.Tensor):
            continue
        if value.shape == out["input_ids"].shape:
            token_fields[key] = value[0]
        else:
            tensors[key] = value
    template_ids = tuple(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    return ImagePromptIds(ids.tolist(), PromptImages(tensors, token_fields, tuple(pictures),
                                                     tuple(image_label(p) for p in pictures), template_ids, len(ids)))


def batch_images(prompt_ids: list) -> tuple[PromptImages | None, ...] | None:
    """Each row's pictures (the same object for the rows of a prompt); None where no row has any."""
    images = tuple(images_of(ids) for ids in prompt_ids)
    return images if any(image is not None for image in images) else None


def model_inputs(images_B: tuple[PromptImages | None, ...], prompt_mask_BP: torch.Tensor, after: int = 0
                 ) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for the pictures of B rows whose (left-padded) prompts are followed by
    ``after`` further columns (their completions): the pixel tensors of every row in order (padded where
    rows hold different numbers of pictures, with zeros, which such models skip), and the token fields
    laid out as the ids are, 0 on padding and on the columns after the prompt."""
    B, P = prompt_mask_BP.shape
    present = [image for image in images_B if image is not None]
    if not present:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key in present[0].tensors:
        parts = [image.tensors[key] for image in present]
        out[key] = _concatenated(parts)
    lengths_B = prompt_mask_BP.sum(1).tolist()
    for key in present[0].token_fields:
        field = torch.zeros(B, P + after, dtype=present[0].token_fields[key].dtype)
        for b, image in enumerate(images_B):
            if image is None:
                continue
            values = image.token_fields[key]
            if len(values) != lengths_B[b]:
                raise ValueError(f"row {b}: its prompt has {lengths_B[b]} tokens and its pictures' {key} "
                                 f"{len(values)}: the pictures do not belong to this prompt")
            field[b, P - len(values):P] = values
        out[key] = field
    return out


def _concatenated(parts: list[torch.Tensor]) -> torch.Tensor:
    """Tensors joined along their first dimension, each padded with zeros to the largest in the others."""
    shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    padded = []
    for p in parts:
        if list(p.shape[1:]) != shape:
            grown = p.new_zeros((p.shape[0], *shape))
            grown[tuple(slice(0, n) for n in p.shape)] = p
            p = grown
        padded.append(p)
    return torch.cat(padded)


def placeholder_token_ids(config: Any) -> list[int]:
    """The ids of a vision-language model's image and video tokens (and the markers around them), which the
    model's processor writes and the model never samples: a sampled one would ask for pixels that are not
    there."""
    ids = set()
    for name in dir(config):
        if any(word in name for word in ("image", "video", "vision", "boi", "eoi")) and \
                name.endswith(("_token_id", "_token_index")):
            value = getattr(config, name, None)
            if isinstance(value, int) and value >= 0:
                ids.add(value)
    return sorted(ids)


@contextlib.contextmanager
def picture_errors() -> Iterator[None]:
    """A model's refusal of a prompt's pictures (its image tokens and its vision tower's features disagree in
    number: a processor of another model) as covey's error, saying what to do."""
    try:
        yield
    except ValueError as e:
        if "image" not in str(e).lower():
            raise
        raise ModelError(f"the model cannot read the prompts' pictures as its processor wrote them ({e}); give the "
                         "model's own processor as processing_class (AutoProcessor.from_pretrained of the model)"
                         ) from e

