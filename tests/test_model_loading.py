"""How the model is loaded: TRL's model arguments (dtype, attn_implementation, model_revision,
model_init_kwargs, quantized loading, LoRA options) and cast_lm_head_to_fp32."""

import copy
import importlib.util

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.errors import ConfigError
from covey.models import Float32Head, ModelLoading, dequantized, load_policy
from tests.conftest import make_model
from tests.test_trainer import ROWS, count_a, small_args


def trained(tmp_path, model, tokenizer, **overrides):
    trainer = GRPOTrainer(model=str(model), reward_funcs=[count_a], args=small_args(tmp_path, eval_max_samples=0,
                          **overrides), train_dataset=ROWS, processing_class=tokenizer, quiet=True)
    trainer.train()
    return trainer


def test_dtype_loads_and_trains_the_weights_in_that_dtype(tmp_path, tokenizer, tiny_model_dir):
    trainer = trained(tmp_path, tiny_model_dir, tokenizer, dtype="bfloat16", max_steps=1)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert trainer.global_step == 1 and (tmp_path / "run" / "final_model").is_dir()


@pytest.mark.parametrize("values", [{"torch_dtype": "bfloat16"}, {"model_init_kwargs": {"torch_dtype": "bfloat16"}},
                                    {"model_init_kwargs": {"dtype": "bfloat16", "low_cpu_mem_usage": True}}])
def test_the_dtype_in_trl_recipes_forms_is_the_dtype_field(values):
    config = GRPOConfig.from_dict(values)
    assert config.dtype == "bfloat16"
    assert config.model_init_kwargs in (None, {"low_cpu_mem_usage": True})  # the rest stays for from_pretrained


def test_model_init_kwargs_and_a_field_that_disagree_are_refused():
    with pytest.raises(ConfigError, match="model_init_kwargs sets torch_dtype='bfloat16' and dtype='float16'"):
        GRPOConfig(dtype="float16", model_init_kwargs={"torch_dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="device_map is set by covey's use_cpu"):
        GRPOConfig(model_init_kwargs={"device_map": "auto"})
    with pytest.raises(ConfigError, match="dtype='float64' is not one of"):
        GRPOConfig(model_init_kwargs={"dtype": "float64"})


def test_loading_settings_reach_from_pretrained(tiny_model_dir, monkeypatch):
    loading = ModelLoading(revision="v2", attn_implementation="eager", init_kwargs=(("low_cpu_mem_usage", True),))
    kwargs = loading.from_pretrained_kwargs()
    assert (kwargs["revision"], kwargs["attn_implementation"], kwargs["low_cpu_mem_usage"], kwargs["dtype"]) == (
        "v2", "eager", True, torch.float32)
    model = load_policy(str(tiny_model_dir), ModelLoading(attn_implementation="eager"))
    assert model.config._attn_implementation == "eager"


def test_a_model_argument_the_model_does_not_take_is_said(tiny_model_dir):
    with pytest.raises(Exception, match="could not load model .*no_such_argument"):
        load_policy(str(tiny_model_dir), ModelLoading(init_kwargs=(("no_such_argument", 1),)))


def test_loading_settings_are_refused_for_a_model_handed_over_loaded(tmp_path, tokenizer, tiny_model):
    with pytest.raises(ConfigError, match="model_init_kwargs, attn_implementation, model_revision say how a model is "
                                          "loaded, and this one was handed over loaded"):
        GRPOTrainer(model=tiny_model, reward_funcs=[count_a], train_dataset=ROWS, processing_class=tokenizer,
                    args=small_args(tmp_path, model_init_kwargs={"low_cpu_mem_usage": True},
                                    attn_implementation="eager", model_revision="v2"))


def test_the_embedded_model_has_one_revision():
    with pytest.raises(ConfigError, match="the embedded model .* has one revision"):
        load_policy(GRPOConfig().model, ModelLoading(revision="v2"))


def test_lora_options_reach_the_adapter(tmp_path, tokenizer, tiny_model_dir):
    trainer = trained(tmp_path, tiny_model_dir, tokenizer, use_peft=True, lora_r=4, use_rslora=True,
                      lora_modules_to_save=["lm_head"], lora_target_modules=["q_proj", "v_proj"], max_steps=1)
    lora = trainer.model.peft_config["default"]
    assert lora.use_rslora and lora.modules_to_save == ["lm_head"] and lora.lora_dropout == 0.05  # TRL's default
    assert sorted(lora.target_modules) == ["q_proj", "v_proj"]


def test_lora_targets_default_to_peft_s_choice_for_the_architecture(tmp_path, tokenizer, tiny_model_dir):
    trainer = trained(tmp_path, tiny_model_dir, tokenizer, use_peft=True, max_steps=1)
    assert sorted(trainer.model.peft_config["default"].target_modules) == ["q_proj", "v_proj"]  # Llama's, as in TRL


def test_cast_lm_head_to_fp32_computes_the_logits_in_float32(tokenizer):
    from covey.models import head_in_float32

    model = make_model(len(tokenizer)).to(torch.bfloat16)
    ids = torch.tensor([[1, 5, 7, 9]])
    head_in_float32(model)
    assert type(model.lm_head) is Float32Head and model.lm_head.weight.dtype == torch.bfloat16  # weights unchanged
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids).logits
    assert logits.dtype == torch.float32
    hidden = model.model(ids).last_hidden_state
    assert torch.equal(logits, hidden.float() @ model.lm_head.weight.float().T)
    reference = copy.deepcopy(model)  # a copy (the reference model) computes with its own weights
    with torch.no_grad():
        reference.lm_head.weight.zero_()
    assert reference(ids).logits.abs().max() == 0 and model(ids).logits.abs().max() > 0


def test_cast_lm_head_to_fp32_trains(tmp_path, tokenizer, tiny_model_dir):
    trainer = trained(tmp_path, tiny_model_dir, tokenizer, cast_lm_head_to_fp32=True, bf16=True, beta=0.1,
                      max_steps=1)
    assert type(trainer.model.lm_head) is Float32Head and type(trainer.reference.frozen.lm_head) is Float32Head


def test_quantized_loading_needs_a_lora_adapter(tmp_path, tokenizer, tiny_model_dir):
    with pytest.raises(ConfigError, match="load_in_4bit loads weights that cannot be trained: train a LoRA adapter"):
        trained(tmp_path, tiny_model_dir, tokenizer, load_in_4bit=True)
    with pytest.raises(ConfigError, match="load_in_4bit and load_in_8bit both set"):
        GRPOConfig(load_in_4bit=True, load_in_8bit=True)


def test_quantized_loading_without_bitsandbytes_says_what_to_install(tmp_path, tokenizer, tiny_model_dir,
                                                                     monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_bitsandbytes(name, *args, **kwargs):
        if name == "bitsandbytes":
            raise ImportError("No module named 'bitsandbytes'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bitsandbytes)
    with pytest.raises(ConfigError, match=r"load_in_8bit loads the model through bitsandbytes, which is not "
                                          r"installed .*pip install 'covey\[quantization\]'"):
        trained(tmp_path, tiny_model_dir, tokenizer, load_in_8bit=True, use_peft=True)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("bits", ["4", "8"])
def test_a_quantized_base_trains_a_lora_adapter(tmp_path, tokenizer, bits):
    import bitsandbytes

    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(  # sizes that bitsandbytes' blocks of 64 divide
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=2, eos_token_id=3, pad_token_id=0)).save_pretrained(folder)
    trainer = trained(tmp_path, folder, tokenizer, **{f"load_in_{bits}bit": True}, use_peft=True, max_steps=2)
    layer = trainer.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(layer, bitsandbytes.nn.Linear4bit if bits == "4" else bitsandbytes.nn.Linear8bitLt)
    assert trainer.global_step == 2 and (tmp_path / "run" / "final_model" / "adapter_config.json").is_file()
    # the fast engine samples with the weights the quantized layers compute with
    x = torch.randn(3, 64)
    tolerance = 1e-5 if bits == "4" else 2e-2  # LLM.int8 quantizes the layer's input too
    assert torch.allclose(layer(x), x @ dequantized(layer).T, atol=tolerance * layer(x).abs().max())
