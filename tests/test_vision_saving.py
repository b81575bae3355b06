"""A vision-language model loaded by name and saved whole: a hub id loads as one with its processor, a processor
that cannot load is said before the model loads, and the final and the exported model of a LoRA run load with
transformers' Auto classes as the model the trainer trained."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from covey import GRPOTrainer
from covey.errors import ConfigError
from covey.rollout import left_pad
from covey.train.forward import SequenceBatch, completion_logprobs
from covey.vision import batch_images
from tests.test_vision import encoded, length_reward, picture_rows, vision_args
from tests.tiny_vision import BUILDERS, saved


# ---- loaded by name -------------------------------------------------------------------------------------------


def test_a_vision_language_model_named_by_hub_id_loads_with_its_processor(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from covey.models import load_policy, load_processing

    commit = "0" * 40  # the hub's layout in the local cache, read offline
    repo = tmp_path / "hub" / "models--tiny-org--tiny-smolvlm"
    saved("idefics3", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    tokenizer, processor = load_processing("tiny-org/tiny-smolvlm", pictures=True)
    assert type(processor).__name__ == "Idefics3Processor" and tokenizer is processor.tokenizer
    assert type(load_policy("tiny-org/tiny-smolvlm")).__name__ == "Idefics3ForConditionalGeneration"


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None,
                    reason="the Qwen-VL processors load where torchvision is installed")
def test_a_family_whose_processor_cannot_load_here_says_so_before_the_model_loads(tmp_path, monkeypatch):
    import covey.models.loading
    from covey.models import load_processing

    model, processor = BUILDERS["qwen2_vl"]()
    folder = tmp_path / "tiny-qwen2-vl"  # the processor's parts as a checkpoint holds them
    model.save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    processor.image_processor.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(processor.chat_template)

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the processor's error")

    monkeypatch.setattr(covey.models.loading, "load_vision_model", not_loaded)
    with pytest.raises(ConfigError, match=r"the training prompts show pictures, and the processor of .* does not "
                                          r"load \(Qwen2VLVideoProcessor requires the Torchvision library.*"
                                          "pip install torchvision"):
        GRPOTrainer(args=vision_args(tmp_path, model=str(folder)), reward_funcs=length_reward,
                    train_dataset=picture_rows(), quiet=True)
    tokenizer, none = load_processing(str(folder))  # prompts of text alone need only its tokenizer
    assert none is None and tokenizer.chat_template


# ---- the saved and the exported model ------------------------------------------------------------------------


def logprobs_of(model, processor, completion: str = "ab c") -> torch.Tensor:
    """The log-probs ``model`` gives one completion of each of two prompts with pictures, as ``processor`` encodes
    them (the trainer's own pass)."""
    tokenizer, ids = encoded(processor, picture_rows(2))
    tokens = tokenizer(completion, add_special_tokens=False)["input_ids"]
    prompt_BP, mask_BP = left_pad(ids, tokenizer.pad_token_id)
    completion_BT = torch.tensor([tokens] * len(ids))
    sequences = SequenceBatch(prompt_BP, mask_BP, completion_BT, torch.ones_like(completion_BT), batch_images(ids))
    with torch.no_grad():
        return completion_logprobs(model.eval(), sequences)[0]


@pytest.mark.parametrize("name", ["idefics3", "llava", "gemma3"])
def test_the_final_and_the_exported_model_load_whole_with_transformers_auto_classes(tmp_path, name):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from covey.train.export import export_model

    base = saved(name, tmp_path / "base")
    model, processor = AutoModelForImageTextToText.from_pretrained(base), AutoProcessor.from_pretrained(base)
    before = logprobs_of(model, processor)
    args = vision_args(tmp_path, use_peft=True, lora_r=4, lora_target_modules=["all-linear"], max_steps=1,
                       gradient_accumulation_steps=1)
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=picture_rows(), args=args,
                          processing_class=processor, quiet=True)
    trainer.train()
    trained = logprobs_of(trainer.model, processor)
    assert float((trained - before).abs().max()) > 1e-4  # the adapter moved the model: the comparisons below see it
    export_model(str(tmp_path / "run"), tmp_path / "exported")
    for folder in (tmp_path / "run" / "final_model", tmp_path / "exported"):
        # the LoRA adapter on its base (final_model/) or merged into it (exported), with the processor beside
        loaded = AutoModelForImageTextToText.from_pretrained(folder)
        loaded_processor = AutoProcessor.from_pretrained(folder)
        assert type(loaded_processor) is type(processor) and loaded_processor.chat_template == processor.chat_template
        assert float((logprobs_of(loaded, loaded_processor) - trained).abs().max()) < 1e-5, folder.name
    assert not (tmp_path / "exported" / "adapter_config.json").exists()  # merged: a plain model
