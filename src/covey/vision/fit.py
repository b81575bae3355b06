"""Whether a vision-language model and the processor that wrote its prompts belong together: each image token
the processor writes stands for one feature of the model's vision tower, so the two must agree on the image
token, on the pixel inputs the tower reads, and on how many features a picture gives. A processor of another
model (another family, or another size of the same) breaks one of these; found on the first prompt with
pictures, before anything samples, it is said as such rather than as the model's own error deep in a pass."""

from __future__ import annotations

from typing import Any

import torch

from covey.errors import ModelError
from covey.vision.inputs import images_of
from covey.vision.models import backbone


def image_token_id(config: Any) -> int | None:
    """The id of the token that stands for one image feature in a vision-language model's prompts."""
    return next((getattr(config, name) for name in ("image_token_id", "image_token_index")
                 if isinstance(getattr(config, name, None), int)), None)


def feature_count(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """How many image features the vision tower (and projector) of ``model`` (a plain transformers model)
    gives for one prompt's pixel inputs."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        features = backbone(model).get_image_features(
            **{key: value.to(device, dtype=dtype if value.is_floating_point() else value.dtype)
               for key, value in tensors.items()})
    features = getattr(features, "pooler_output", features)
    if isinstance(features, (list, tuple)):
        return sum(int(f.shape[0]) for f in features)
    return int(features.numel() // model.config.get_text_config().hidden_size)


def check_processor_fits(model: torch.nn.Module, processor: Any, prompt_ids: list) -> None:
    """The first prompt with pictures has as many of ``model``'s image tokens (a plain transformers model) as
    its vision tower gives features for the pictures ``processor`` made of them; else the processor is not
    the model's, said with what disagrees."""
    first = next((ids for ids in prompt_ids if images_of(ids) is not None), None)
    if first is None:
        return
    token = image_token_id(model.config)
    try:
        features = feature_count(model, images_of(first).tensors)
    except (TypeError, ValueError, RuntimeError, AttributeError, IndexError, KeyError) as e:
        why = f"the vision tower cannot read the pixel inputs the processor made ({type(e).__name__}: {e})"
    else:
        tokens = list(first).count(token)
        if tokens == features > 0:
            return
        why = (f"the first prompt with pictures holds {tokens} of the model's image tokens (id {token}) and the vision "
               f"tower gives {features} features for its pictures (one token per feature)")
    raise ModelError(f"the processor {type(processor).__name__} does not belong to the model "
                     f"{type(model).__name__}: {why}; give the model's own processor as processing_class "
                     "(AutoProcessor.from_pretrained of the model's folder or hub id)")
