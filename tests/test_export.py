"""covey export: a trained policy as a plain Hugging Face model that transformers loads on its own."""

from __future__ import annotations

import json

import pytest
import torch

from covey.cli import main
from covey.errors import ConfigError
from covey.train.export import export_model
from covey.errors import ModelError
from covey.models import load_policy

from tests.conftest import make_model, trained_lora


def trained_adapter(base_dir, targets):
    """A LoRA policy on the model saved in ``base_dir``, as after training."""
    return trained_lora(load_policy(str(base_dir)), targets)


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


IDS = [5, 17, 30, 41, 9, 22]


def test_a_saved_adapter_exports_merged_into_a_model_that_pipeline_loads(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, pipeline

    policy = trained_adapter(tiny_model_dir, ["all-linear"])
    policy.save_pretrained(tmp_path / "adapter")  # no tokenizer beside it: the base model's is taken

    out = export_model(str(tmp_path / "adapter"), tmp_path / "exported")

    assert not (out / "adapter_config.json").exists() and (out / "tokenizer_config.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.allclose(logits(exported, IDS), logits(policy, IDS), atol=1e-5, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert not torch.allclose(logits(exported, IDS), logits(base, IDS), atol=1e-3)  # the adapter's change is in it
    generator = pipeline("text-generation", model=str(out))
    text = generator("abc", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("abc") and len(text) > 3


@pytest.mark.parametrize("side", ["lm_head", "embed_tokens"])
def test_an_adapter_on_one_side_of_a_tied_head_exports_with_the_two_untied(tmp_path, tiny_model_dir, side):
    from transformers import AutoModelForCausalLM

    policy = trained_adapter(tiny_model_dir, ["q_proj", side])
    policy.save_pretrained(tmp_path / "adapter")

    out = export_model(str(tmp_path / "adapter"), tmp_path / "exported")

    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.allclose(logits(exported, IDS), logits(policy, IDS), atol=1e-5, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # the side the adapter is on changed; the other is the base's
    kept, changed = ((exported.get_input_embeddings(), exported.get_output_embeddings()) if side == "lm_head"
                     else (exported.get_output_embeddings(), exported.get_input_embeddings()))
    assert torch.equal(kept.weight, base.get_input_embeddings().weight)
    assert not torch.allclose(changed.weight, base.get_input_embeddings().weight, atol=1e-3)


def test_an_adapter_other_than_lora_is_refused_by_name(tmp_path, tiny_model_dir):
    from peft import LoHaConfig, get_peft_model

    get_peft_model(load_policy(str(tiny_model_dir)), LoHaConfig(target_modules=["q_proj"])).save_pretrained(
        tmp_path / "adapter")
    with pytest.raises(ModelError, match="is LOHA, not LoRA: covey merges plain LoRA adapters only"):
        export_model(str(tmp_path / "adapter"), tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


def test_a_run_folder_exports_its_final_model_and_a_checkpoint_its_model(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    for folder, seed in ((run / "final_model", 1), (run / "checkpoints" / "checkpoint-2" / "model", 2)):
        make_model(len(tokenizer), seed=seed).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    (run / "metrics.jsonl").write_text("")
    (run / "checkpoints" / "checkpoint-2" / "state.json").write_text(json.dumps({"step": 2}))

    final = export_model(str(run), tmp_path / "final", dtype="bfloat16")
    step_2 = export_model(str(run / "checkpoints" / "checkpoint-2"), tmp_path / "step-2")

    exported = AutoModelForCausalLM.from_pretrained(final)
    assert exported.dtype == torch.bfloat16
    assert torch.equal(exported.lm_head.weight, make_model(len(tokenizer), seed=1).lm_head.weight.bfloat16())
    assert torch.equal(AutoModelForCausalLM.from_pretrained(step_2).lm_head.weight,
                       make_model(len(tokenizer), seed=2).lm_head.weight)


def test_export_refuses_bad_input_before_loading_anything(tmp_path, tiny_model_dir):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="already exists.*overwrites nothing"):
        export_model(str(tiny_model_dir), taken)
    assert (taken / "mine.txt").read_text() == "keep" and len(list(taken.iterdir())) == 1
    with pytest.raises(ConfigError, match="--dtype 'int8' is not one of float32, bfloat16, float16"):
        export_model(str(tiny_model_dir), tmp_path / "out", dtype="int8")
    with pytest.raises(ConfigError, match="is not a folder: create it first"):
        export_model(str(tiny_model_dir), tmp_path / "missing" / "out")
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="without final_model/.*export one of its checkpoints"):
        export_model(str(unfinished), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_covey_export_on_the_command_line(tmp_path, tiny_model_dir, capsys):
    assert main(["export", str(tiny_model_dir), str(tmp_path / "out"), "--dtype", "float16"]) == 0
    assert "exported" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float16"
    assert main(["export", str(tiny_model_dir), str(tmp_path / "out")]) == 2  # it exists: refused, kept
    assert "already exists" in capsys.readouterr().err
