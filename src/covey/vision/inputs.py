"""A prompt's pictures as the model takes them, from encoding to every pass that reads the prompt.

The model's processor writes a prompt with pictures: its chat template puts each picture's placeholder,
the processor expands it to as many image tokens as the picture gives features, and returns the pixel
tensors the vision tower reads (``pixel_values``, and per family ``image_grid_thw``,
``pixel_attention_mask``, ``image_sizes``...) and fields that go token by token with the ids
(``mm_token_type_ids``, ``token_type_ids``). ``encode_image_prompt`` keeps all of them with the prompt's
ids (``ImagePromptIds``, a list of ids that carries its ``PromptImages``), so that sampling and every
log-prob pass (training, old policy, reference) hand the model the very same inputs:
``model_inputs`` puts those of a batch's rows together. A tool message that shows pictures, later in an
episode, adds them (``with_pictures_shown``): the sequence's ids then carry the pictures of its prompt and
of its tool messages, in order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from covey.errors import DataError, ModelError
from covey.vision.rows import image_label, prompt_images


@dataclass(frozen=True)
class Expansion:
    """Where the processor expanded picture placeholders: ``length`` ids from ``start`` (counted from the
    prompt's first token) that the chat template wrote as ``template_ids``, each picture one placeholder."""

    start: int
    length: int
    template_ids: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class PromptImages:
    """What the pictures of one prompt, and of the messages its episode added, are to the model, as its
    processor gave them."""

    tensors: dict[str, torch.Tensor]  # pixel tensors and their shapes, as the processor gives them for one sequence
    # fields that go with each token, from the prompt's first (those after them are 0: text)
    token_fields: dict[str, torch.Tensor]
    pictures: tuple  # the PIL images, in order (what an engine with its own processor, vLLM, is given)
    labels: tuple[str, ...]  # each picture's label (``image_label``)
    template_text: str = ""  # the chat template's text of the messages that show them, each picture a placeholder
    expansions: tuple[Expansion, ...] = ()  # where their placeholders were expanded: the prompt's first

    def unexpanded(self, ids: list[int]) -> list[int]:
        """``ids`` (this prompt, expanded, and what followed it) with each picture as the chat template wrote it
        (what vLLM expands itself)."""
        out, at = [], 0
        for expansion in self.expansions:
            out += [*ids[at:expansion.start], *expansion.template_ids]
            at = expansion.start + expansion.length
        return out + list(ids[at:])

    @property
    def count(self) -> int:
        return len(self.pictures)

    @property
    def prompt_length(self) -> int:
        """The prompt's length, its pictures expanded (0 where the prompt shows none)."""
        return self.expansions[0].length if self.expansions and self.expansions[0].start == 0 else 0


@dataclass(frozen=True)
class ShownPictures:
    """The pictures of messages added after a prompt (a tool's result), as the processor wrote those messages."""

    pictures: tuple
    text: str  # the chat template's text of a conversation ending with the messages: a placeholder per picture
    template_ids: tuple[int, ...]  # the messages' ids as the chat template wrote them
    ids: tuple[int, ...]  # and as the processor expanded them
    token_fields: dict[str, torch.Tensor]  # the fields that go with each of ``ids``


def with_pictures_shown(images: PromptImages | None, processor: Any, shown: ShownPictures, start: int) -> PromptImages:
    """A sequence's pictures (``images``: its prompt's and those shown since, or None) and those of messages
    appended at ``start`` tokens from the prompt's first: the pixel tensors of all of them in order, as the
    processor gives them for one sequence, and the token fields of every token up to the messages' end."""
    before = images or PromptImages({}, {}, (), ())
    pictures = (*before.pictures, *shown.pictures)
    _, _, tensors = processed(processor, before.template_text + shown.text, list(pictures), "the episode")
    fields = {}
    for key, values in shown.token_fields.items():
        earlier = before.token_fields.get(key, values.new_zeros(0))
        gap = values.new_zeros(start - len(earlier))
        fields[key] = torch.cat([earlier, gap, values])
    return PromptImages(tensors, fields, pictures, (*before.labels, *(image_label(p) for p in shown.pictures)),
                        before.template_text + shown.text,
                        (*before.expansions, Expansion(start, len(shown.ids), shown.template_ids)))


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


def processed(processor: Any, text: str, pictures: list, where: str
              ) -> tuple[list[int], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``text`` (a placeholder per picture) and its ``pictures`` through the model's processor: (the ids, each
    placeholder expanded to its picture's image tokens; the fields that go with each id; the pixel tensors)."""
    try:
        out = processor(text=[text], images=[pictures], add_special_tokens=False, return_tensors="pt")
    except (ValueError, TypeError) as e:
        raise DataError(f"{where}: the model's processor cannot take this text with its {len(pictures)} "
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
    return ids.tolist(), token_fields, tensors


def encode_image_prompt(processor: Any, messages: list[dict], where: str, **template_kwargs: Any) -> ImagePromptIds:
    """A chat prompt with pictures through the model's processor: the chat template (assistant turn opened,
    ``template_kwargs`` such as tools) with each image placeholder expanded to the picture's image tokens."""
    pictures = prompt_images(messages)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    ids, token_fields, tensors = processed(processor, text, pictures, f"{where}: this prompt")
    template_ids = tuple(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    return ImagePromptIds(ids, PromptImages(tensors, token_fields, tuple(pictures),
                                            tuple(image_label(p) for p in pictures), text,
                                            (Expansion(0, len(ids), template_ids),)))


def batch_images(prompt_ids: list) -> tuple[PromptImages | None, ...] | None:
    """Each row's pictures (the same object for the rows of a prompt); None where no row has any."""
    images = tuple(images_of(ids) for ids in prompt_ids)
    return images if any(image is not None for image in images) else None


def model_inputs(images_B: tuple[PromptImages | None, ...], prompt_mask_BP: torch.Tensor, after: int = 0
                 ) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for the pictures of B rows whose (left-padded) prompts are followed by
    ``after`` further columns (their completions): the pixel tensors of every row in order (padded where
    rows hold different numbers of pictures, with zeros, which such models skip), and the token fields
    laid out as the ids are, from each row's first token (0 on padding and after the fields' end)."""
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
            if image is None or key not in image.token_fields:
                continue
            values, first = image.token_fields[key], P - lengths_B[b]
            if len(values) > lengths_B[b] + after or lengths_B[b] < image.prompt_length:
                raise ValueError(f"row {b}: its prompt has {lengths_B[b]} tokens (and {after} columns after it), and "
                                 f"its pictures' {key} {len(values)}: the pictures do not belong to this prompt")
            field[b, first:first + len(values)] = values
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

