"""Vision-language models: prompts with pictures in TRL's conventions (``rows``), a prompt's pictures as
the model takes them in every pass (``inputs``), and loading such models and choosing what of them trains
(``models``)."""

from covey.vision.inputs import (ImagePromptIds, PromptImages, ShownPictures, batch_images, encode_image_prompt,
                                 images_of, model_inputs, picture_errors, placeholder_token_ids, processed,
                                 with_images_of, with_pictures_shown)
from covey.vision.models import (backbone, freeze_vision_parts, is_processor, is_vision_model, lora_exclusion,
                                 processor_of, text_tokenizer, vision_parts)
from covey.vision.rows import (content_text, has_images, image_label, image_parts, jsonable, prompt_images,
                               valid_content, with_images_in_prompts)

__all__ = ["ImagePromptIds", "PromptImages", "ShownPictures", "backbone", "batch_images", "content_text",
           "encode_image_prompt", "freeze_vision_parts", "has_images", "image_label", "image_parts", "images_of",
           "is_processor", "is_vision_model", "jsonable", "lora_exclusion", "model_inputs", "picture_errors",
           "placeholder_token_ids", "processed", "processor_of", "prompt_images", "text_tokenizer", "valid_content",
           "vision_parts", "with_images_in_prompts", "with_images_of", "with_pictures_shown"]
