"""Tiny random-weight vision-language models and their processors, built offline from configs: Qwen2-VL
(images as patches with a (t, h, w) grid and 3-D rotary positions) and Idefics3 (SmolVLM's family: images
as tiles with a pixel mask). The tokenizer is the tests' character-level one with each family's image
tokens added, and a chat template that writes the family's image placeholder for every image part."""

from __future__ import annotations

import numpy as np
import torch

from tests.conftest import make_tokenizer

# the tests' chat template, reading content given as a list of {"type": "image"} / {"type": "text"} parts
VISION_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}IMAGE{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")
FAMILIES = ("qwen2_vl", "idefics3")


def image(seed: int = 0, size: tuple[int, int] = (40, 56)):
    """A small random RGB picture."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8")
    return Image.fromarray(pixels)


def _tokenizer(tokens: list[str], placeholder: str):
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = VISION_TEMPLATE.replace("IMAGE", placeholder)
    return tokenizer


def qwen2_vl(seed: int = 0):
    """(model, processor) of a tiny Qwen2-VL."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImagesOnly(Qwen2VLProcessor):
        """Qwen2-VL's processor without its video part (which needs torchvision, absent here)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
                           "<|vision_start|><|image_pad|><|vision_end|>")
    processor = ImagesOnly(image_processor=Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56 * 2),
                           tokenizer=tokenizer, video_processor=None, chat_template=tokenizer.chat_template)
    token = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [8, 4, 4]},
                         bos_token_id=2, eos_token_id=3, pad_token_id=0),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
        bos_token_id=2, eos_token_id=3, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 2, 3
    return model, processor


def idefics3(seed: int = 0):
    """(model, processor) of a tiny Idefics3 (SmolVLM's architecture): one 32-pixel tile per image, one
    image token each; heads of 32 dimensions (the smallest vLLM's CPU attention takes)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = _tokenizer(["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"], "<image>")
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 32}, max_image_size={"longest_edge": 32},
                                                do_image_splitting=False)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=1,
                                  chat_template=tokenizer.chat_template)
    config = Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512, bos_token_id=2, eos_token_id=3, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), bos_token_id=2, eos_token_id=3,
        pad_token_id=0)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 2, 3
    return model, processor


BUILDERS = {"qwen2_vl": qwen2_vl, "idefics3": idefics3}


def saved(family: str, folder) -> str:
    """The family's tiny model saved with its processor as a Hugging Face folder (as vLLM loads one)."""
    model, processor = BUILDERS[family]()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


def llava(seed: int = 0):
    """(model, processor) of a tiny LLaVA: a CLIP vision tower on 32-pixel pictures, four image tokens each."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = _tokenizer(["<image>"], "<image>")
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=16,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=tokenizer.chat_template)
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512, bos_token_id=2, eos_token_id=3, pad_token_id=0),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=16, projection_dim=32),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
        vision_feature_layer=-1, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 2, 3
    return model, processor


BUILDERS["llava"] = llava
