"""Tiny random-weight vision-language models and their processors, built offline from configs, one per family
covey is tested on: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (images as patches with a (t, h, w) grid and 3-D rotary
positions), Idefics3 (SmolVLM's family: images as tiles with a pixel mask), LLaVA (a CLIP tower, a fixed number
of image tokens) and Gemma 3 (a SigLIP tower pooled to a fixed number of soft tokens, attending to each other
both ways). The tokenizer is the tests' character-level one with each family's image tokens added, and a chat
template that writes the family's image placeholder for every image part."""

from __future__ import annotations

import numpy as np
import torch

from tests.conftest import make_tokenizer

# the tests' chat template, reading content given as a list of {"type": "image"} / {"type": "text"} parts
VISION_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}IMAGE{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "llava", "gemma3")
IDS = dict(bos_token_id=2, eos_token_id=3, pad_token_id=0)  # the tests' tokenizer's <s>, </s> and <pad>
# the language model of every family: two layers, 64 wide
TEXT = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=512, **IDS)


def image(seed: int = 0, size: tuple[int, int] = (40, 56)):
    """A small random RGB picture."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8")
    return Image.fromarray(pixels)


def _tokenizer(tokens: list[str], placeholder: str, named: dict[str, str] | None = None):
    """The tests' tokenizer with ``tokens`` added, and ``named`` special tokens it knows by name
    (``tokenizer.boi_token``...), whose chat template writes ``placeholder`` for each image part."""
    tokenizer = make_tokenizer()
    if named:
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, pad_token="<pad>",
                                            unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                            extra_special_tokens=named)
    if tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = VISION_TEMPLATE.replace("IMAGE", placeholder)
    return tokenizer


def _built(model_class, config, seed: int):
    """The model of ``config``, its weights drawn from ``seed``, generating up to the tests' end token."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 2, 3
    return model


def _qwen_vl(family: str, seed: int, vision: dict, patch_size: int, text: dict | None = None):
    """(model, processor) of a tiny model of the Qwen-VL kind (``family``: the transformers module's name),
    pictures of at most 2 x 4 merged patches."""
    import importlib

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    module = importlib.import_module(f"transformers.models.{family}")
    name = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}[family]

    class ImagesOnly(getattr(module, f"{name}Processor")):
        """The family's processor without its video part (which needs torchvision, absent here)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
                           "<|vision_start|><|image_pad|><|vision_end|>")
    side = 2 * patch_size
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=2, min_pixels=side * side,
                                               max_pixels=side * side * 8)
    processor = ImagesOnly(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                           chat_template=tokenizer.chat_template)
    token = tokenizer.convert_tokens_to_ids
    config = getattr(module, f"{name}Config")(
        text_config=dict(TEXT, vocab_size=len(tokenizer), **(text or {})),
        vision_config=dict(vision, patch_size=patch_size, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"), **IDS)
    return _built(getattr(module, f"{name}ForConditionalGeneration"), config, seed), processor


def qwen2_vl(seed: int = 0):
    """(model, processor) of a tiny Qwen2-VL."""
    return _qwen_vl("qwen2_vl", seed, dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
                    patch_size=14, text=dict(rope_scaling={"type": "mrope", "mrope_section": [8, 4, 4]}))


def qwen2_5_vl(seed: int = 0):
    """(model, processor) of a tiny Qwen2.5-VL: a vision tower of windowed attention (one window, its one layer
    of full attention) and gated MLPs."""
    return _qwen_vl("qwen2_5_vl", seed, dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                             out_hidden_size=64, window_size=56, fullatt_block_indexes=[0]),
                    patch_size=14, text=dict(rope_scaling={"type": "mrope", "mrope_section": [8, 4, 4]}))


def qwen3_vl(seed: int = 0):
    """(model, processor) of a tiny Qwen3-VL: 16-pixel patches, learned position embeddings in the vision tower,
    and a deep-stack layer whose features join the language model's first layers; interleaved 3-D positions."""
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[1])
    rope = {"rope_type": "default", "mrope_section": [8, 4, 4], "mrope_interleaved": True}
    return _qwen_vl("qwen3_vl", seed, vision, patch_size=16, text=dict(head_dim=32, rope_scaling=rope))


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
        text_config=dict(TEXT, model_type="llama", vocab_size=len(tokenizer)),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), **IDS)
    return _built(Idefics3ForConditionalGeneration, config, seed), processor


def llava(seed: int = 0):
    """(model, processor) of a tiny LLaVA: a CLIP vision tower on 32-pixel pictures, four image tokens each."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = _tokenizer(["<image>"], "<image>")
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=16,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=tokenizer.chat_template)
    config = LlavaConfig(
        text_config=dict(TEXT, model_type="llama", vocab_size=len(tokenizer)),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=16, projection_dim=32),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
        vision_feature_layer=-1, **IDS)
    return _built(LlavaForConditionalGeneration, config, seed), processor


def gemma3(seed: int = 0):
    """(model, processor) of a tiny Gemma 3: a SigLIP tower on 32-pixel pictures pooled to four soft tokens, each
    picture written as its begin-of-image token, the soft tokens and its end-of-image token; the projector drawn
    at random, as after training (transformers starts it at zero)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = _tokenizer([], "<start_of_image>", named=named)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                tokenizer=tokenizer, image_seq_length=4, chat_template=tokenizer.chat_template)
    config = Gemma3Config(
        text_config=dict(TEXT, vocab_size=len(tokenizer), head_dim=32, sliding_window=64),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        mm_tokens_per_image=4, boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"), image_token_index=tokenizer.image_token_id,
        **IDS)
    model = _built(Gemma3ForConditionalGeneration, config, seed)
    with torch.no_grad():  # the projector starts at zero (pictures unseen until trained): give it weights
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
    return model, processor


BUILDERS = {"qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl, "idefics3": idefics3,
            "llava": llava, "gemma3": gemma3}


def saved(family: str, folder) -> str:
    """The family's tiny model saved with its processor as a Hugging Face folder (as vLLM loads one)."""
    model, processor = BUILDERS[family]()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)
