"""The vLLM engine's parts that need no vLLM (fake vLLM output objects); the engine against real vLLM
is tests/vllm's."""

import copy
import importlib.util
import sys
from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn

from covey import GRPOConfig
from covey.errors import ConfigError, ModelError
from covey.models import add_lora, base_parameter_name, load_policy, policy_weights
from covey.rollout import EngineSettings, SamplingParams, make_engine
from covey.rollout.vllm_engine import (check_vllm, cpu_kv_cache_bytes, finish_reason, llm_kwargs, model_source, request_seeds,
                                       rollout_from_outputs, version_problem)
from covey.rollout.wire import sampling_fields
from covey.train.setup import engine_settings
from tests.conftest import make_model


def completion(index, tokens, logps, reason="length", stop_reason=None):
    """Shaped like vLLM's CompletionOutput with logprobs=0: one {token: Logprob} per step."""
    steps = [{t: NS(logprob=lp, rank=1, decoded_token=None)} for t, lp in zip(tokens, logps)]
    return NS(index=index, token_ids=tokens, logprobs=steps, finish_reason=reason, stop_reason=stop_reason)


# ---- sampling settings -------------------------------------------------------------------------------


def test_sampling_settings_map_to_vllm():
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05,
                            repetition_penalty=1.1, stop=("</answer>",))
    assert sampling_fields(params, 4, [3, 7]) == dict(
        n=4, max_tokens=12, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1,
        stop=["</answer>"], include_stop_str_in_output=True, stop_token_ids=[3, 7], logprobs=0)
    greedy = sampling_fields(SamplingParams(max_new_tokens=3, temperature=0.7, top_k=5, greedy=True), 1, [3])
    assert (greedy["temperature"], greedy["top_p"], greedy["top_k"], greedy["min_p"]) == (0.0, 1.0, 0, 0.0)
    assert greedy["stop"] == [] and greedy["logprobs"] == 0


def test_request_seeds_are_reproducible_and_do_not_repeat_across_rounds():
    assert request_seeds(None, 3) == [None, None, None]
    first = request_seeds(42, 4)
    assert first == request_seeds(42, 4) and len(set(first)) == 4
    # vLLM seeds the samples of a prompt seed, seed + 1, ...: the next round must not reuse them
    taken = {s + j for s in first for j in range(8)}
    assert not taken & {s + j for s in request_seeds(43, 4) for j in range(8)}


# ---- outputs -------------------------------------------------------------------------------------------


def test_finish_reasons_tell_eos_from_stop_strings():
    assert finish_reason(NS(finish_reason="length", stop_reason=None)) == "length"
    assert finish_reason(NS(finish_reason="stop", stop_reason=None)) == "eos"  # the model's EOS
    assert finish_reason(NS(finish_reason="stop", stop_reason=7)) == "eos"  # one of covey's stop_token_ids
    assert finish_reason(NS(finish_reason="stop", stop_reason="</answer>")) == "stop"
    with pytest.raises(ModelError, match="finish_reason='abort'"):
        finish_reason(NS(finish_reason="abort", stop_reason=None))


def test_outputs_become_a_padded_rollout_in_prompt_then_sample_order():
    outputs = [
        NS(outputs=[completion(1, [5, 3], [-0.5, -0.25], "stop"), completion(0, [8, 9, 10], [-1.0, -2.0, -3.0])]),
        NS(outputs=[completion(0, [11], [-0.125], "stop", "x"), completion(1, [12, 13, 14, 15], [-1.5] * 4)]),
    ]
    rollout = rollout_from_outputs(outputs, 2, pad_token_id=0)
    assert rollout.completion_ids_BT.tolist() == [[8, 9, 10, 0], [5, 3, 0, 0], [11, 0, 0, 0], [12, 13, 14, 15]]
    assert rollout.completion_mask_BT.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert rollout.sampling_logp_BT.tolist() == [[-1.0, -2.0, -3.0, 0.0], [-0.5, -0.25, 0.0, 0.0],
                                                 [-0.125, 0.0, 0.0, 0.0], [-1.5] * 4]
    assert rollout.completion_mask_BT.dtype == torch.long and rollout.sampling_logp_BT.dtype == torch.float32
    assert rollout.finish_reasons == ["length", "eos", "stop", "length"]


def test_malformed_outputs_are_errors():
    with pytest.raises(ModelError, match="returned 1 completions for a prompt, expected num_generations=2"):
        rollout_from_outputs([NS(outputs=[completion(0, [5], [-1.0])])], 2, 0)
    no_logprobs = completion(0, [5], [-1.0])
    no_logprobs.logprobs = None
    with pytest.raises(ModelError, match="no log-prob"):
        rollout_from_outputs([NS(outputs=[no_logprobs])], 1, 0)


# ---- weights and names ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, expected", [
    ("model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
    ("model.embed_tokens.lora_embedding_B.default", None),
    ("model.layers.1.mlp.up_proj.lora_magnitude_vector.default.weight", None),
    ("lm_head.modules_to_save.default.weight", "lm_head.weight"),
    ("lm_head.modules_to_save.other.weight", None),
    ("lm_head.original_module.weight", None),
    ("model.norm.weight", "model.norm.weight"),
])
def test_base_parameter_names(name, expected):
    assert base_parameter_name(name, ["default"]) == expected


def test_plain_policy_weights_are_its_parameters(tokenizer):
    model = make_model(len(tokenizer))
    weights = dict(policy_weights(model))
    assert list(weights) == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 3)


def _randomised(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.normal_()
    return model


@pytest.mark.parametrize("config", [
    dict(target_modules=["lin", "emb"], modules_to_save=["head"]),  # embedding LoRA, a fully trained head
    dict(target_modules=["lin"], lora_bias=True),  # LoRA's own bias is merged into the layer's bias
])
def test_lora_weights_are_merged_like_merge_and_unload_without_touching_the_model(config):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    policy = _randomised(get_peft_model(Tiny(), LoraConfig(r=2, lora_alpha=4, **config)))
    snapshot = {n: p.clone() for n, p in policy.state_dict().items()}
    weights = dict(policy_weights(policy))
    merged = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    assert weights.keys() == merged.keys() == {"emb.weight", "lin.weight", "lin.bias", "head.weight", "head.bias"}
    for name in merged:
        assert torch.allclose(weights[name], merged[name], atol=1e-6, rtol=0), name
    changed = "emb.weight" if "emb" in config["target_modules"] else "lin.bias"  # the adapter reached it
    assert not torch.allclose(weights[changed], policy.get_base_model().state_dict()[changed.replace(".", ".base_layer.")])
    assert all(torch.equal(p, snapshot[n]) for n, p in policy.state_dict().items())
    assert not any(getattr(m, "merged", False) for m in policy.modules())


def test_lora_llama_weights_have_the_plain_model_names(tokenizer):
    base = make_model(len(tokenizer))
    policy = _randomised(add_lora(copy.deepcopy(base), 4, 8, 0.0, ["all-linear"]))
    weights = dict(policy_weights(policy))
    assert list(weights) == [n for n, _ in base.named_parameters()]
    merged = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    assert all(torch.allclose(weights[n], merged[n], atol=1e-6, rtol=0) for n in merged)


@pytest.mark.parametrize("adapted", ["lm_head", "embed_tokens"])
def test_a_tied_head_and_embedding_come_apart_when_an_adapter_changes_either(tokenizer, adapted):
    from peft import LoraConfig, get_peft_model

    base = make_model(len(tokenizer))  # ties its head to the embedding
    policy = _randomised(get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj", adapted])))
    weights = dict(policy_weights(policy))
    assert list(weights) == [n for n, _ in base.named_parameters()] + ["lm_head.weight"]
    model = policy.get_base_model()
    with torch.no_grad():  # each side is what the adapted model computes with
        hidden, ids = torch.randn(3, base.config.hidden_size), torch.tensor([4, 9, 17])
        assert torch.allclose(hidden @ weights["lm_head.weight"].T, model.lm_head(hidden), atol=1e-5)
        assert torch.allclose(weights["model.embed_tokens.weight"][ids], model.model.embed_tokens(ids), atol=1e-5)
    unchanged = "model.embed_tokens.weight" if adapted == "lm_head" else "lm_head.weight"
    assert torch.equal(weights[unchanged], base.model.embed_tokens.weight)
    with pytest.raises(ModelError, match=f"leave {adapted} out of lora_target_modules"):
        dict(policy_weights(policy, tied_copy=True))
    # without an adapter on either, the tied head is the embedding: nothing apart
    plain = _randomised(add_lora(copy.deepcopy(base), 4, 8, 0.0, ["all-linear"]))
    assert "lm_head.weight" not in dict(policy_weights(plain, tied_copy=True))


def test_adapters_other_than_plain_lora_are_refused(tokenizer):
    from peft import IA3Config, LoraConfig, get_peft_model

    ia3 = get_peft_model(make_model(len(tokenizer)), IA3Config(target_modules=["k_proj", "down_proj"],
                                                                feedforward_modules=["down_proj"]))
    with pytest.raises(ModelError, match="adapter 'default' is IA3, not LoRA"):
        dict(policy_weights(ia3))
    tokens = get_peft_model(make_model(len(tokenizer)), LoraConfig(r=2, target_modules=["q_proj"],
                                                                   trainable_token_indices=[5]))
    with pytest.raises(ModelError, match="trainable_token_indices"):
        dict(policy_weights(tokens))


def test_a_lora_bias_on_a_layer_without_one_is_refused(tokenizer):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(make_model(len(tokenizer)), LoraConfig(r=2, target_modules=["q_proj"], lora_bias=True))
    with pytest.raises(ModelError, match="adds a bias .lora_bias. to a layer that has none of its own"):
        dict(policy_weights(policy))


def test_dora_is_refused(tokenizer):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(Tiny(), LoraConfig(r=2, target_modules=["lin"], use_dora=True))
    with pytest.raises(ModelError, match="LoRA variant"):
        dict(policy_weights(policy))


# ---- engine settings ----------------------------------------------------------------------------------------


def test_llm_settings_follow_the_config(tmp_path):
    args = GRPOConfig(max_prompt_length=100, max_completion_length=28, seed=7, vllm_gpu_memory_utilization=0.45,
                      use_vllm=True, vllm_enable_sleep_mode=True)
    kwargs = llm_kwargs(engine_settings(args, torch.device("cpu")), str(tmp_path))
    memory = (dict(gpu_memory_utilization=0.45) if torch.cuda.is_available()
              else dict(kv_cache_memory_bytes=cpu_kv_cache_bytes(0.45)))
    assert kwargs == dict(model=str(tmp_path), dtype="float32", seed=7, max_model_len=128, trust_remote_code=False,
                          logprobs_mode="processed_logprobs", distributed_executor_backend="external_launcher",
                          enable_prefix_caching=True, enable_sleep_mode=True, **memory)
    assert 0 < cpu_kv_cache_bytes(0.45) < cpu_kv_cache_bytes(0.9)
    assert llm_kwargs(engine_settings(GRPOConfig(bf16=True), torch.device("cpu")), "m")["dtype"] == "bfloat16"


def test_model_source_is_where_the_policy_came_from(tiny_model_dir, tokenizer):
    loaded = load_policy(str(tiny_model_dir))
    assert model_source(loaded) == str(tiny_model_dir)
    assert model_source(add_lora(loaded, 2, 4, 0.0, ["all-linear"])) == str(tiny_model_dir)
    with pytest.raises(ModelError, match="built in memory; save it with save_pretrained"):
        model_source(make_model(len(tokenizer)))


# ---- the installed vLLM ------------------------------------------------------------------------------------


@pytest.mark.parametrize("version, problem", [
    ("0.32.0", None), ("0.32.3+cpu", None), ("0.31.2", "older than the releases covey is tested with"),
    ("0.33.0", "newer than the releases covey is tested with"), ("1.0.0rc1", "newer"), ("main", "cannot read"),
])
def test_vllm_versions_outside_the_tested_range_are_refused_with_the_way_out(version, problem):
    found = version_problem(version)
    if problem is None:
        assert found is None
    else:
        assert problem in found and ("vllm>=0.32,<0.33" in found or "cannot read" in found)
    if problem and "cannot" not in problem:
        assert "COVEY_ALLOW_UNTESTED_VLLM=1" in found


def test_an_untested_vllm_is_refused_before_any_model_loads(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # as if installed
    monkeypatch.setattr("covey.rollout.vllm_engine.installed_vllm_version", lambda: "0.30.1")
    monkeypatch.delenv("COVEY_ALLOW_UNTESTED_VLLM", raising=False)
    with pytest.raises(ConfigError, match="vLLM 0.30.1 is older than the releases covey is tested with"):
        check_vllm()
    monkeypatch.setenv("COVEY_ALLOW_UNTESTED_VLLM", "1")
    check_vllm()  # the way out, taken


def test_sleep_mode_is_for_vllm_colocate_only():
    with pytest.raises(ConfigError, match="vllm_enable_sleep_mode puts the vLLM of vllm_mode: colocate to sleep"):
        GRPOConfig(vllm_enable_sleep_mode=True)
    with pytest.raises(ConfigError, match=r"vllm_mode: server \(a vLLM server sleeps by its own flags\)"):
        GRPOConfig(use_vllm=True, vllm_mode="server", vllm_enable_sleep_mode=True)
    assert GRPOConfig(use_vllm=True, vllm_enable_sleep_mode=True).vllm_enable_sleep_mode


def test_vllm_needs_the_package(tokenizer, monkeypatch):
    model = make_model(len(tokenizer))
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"needs vLLM, which is not installed; install it with pip install "
                                          r"'covey\[vllm\]'"):
        make_engine("vllm", EngineSettings(), model, tokenizer, [3])
