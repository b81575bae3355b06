"""rollout_engine: vllm, vllm_mode: colocate, against vLLM itself: its samples and log-probs, weights
pushed into it (full fine-tuning and LoRA), a training run sampling with it, and what it refuses."""

from __future__ import annotations

import json
import os

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.errors import ConfigError
from covey.rollout import SamplingParams
from covey.rollout.vllm_engine import check_vllm, model_problem
from tests.conftest import trained_lora
from tests.vllm.conftest import ENV_AT_START, GREEDY, PROCESS_GROUP_ENV, assert_greedy_of, completions, largest_logprob_gap



SAMPLED = SamplingParams(max_new_tokens=32, temperature=1.0)


def perturbed(policy, scale: float = 0.02, seed: int = 0):
    """``policy`` with every weight moved, as by training: its greedy output changes."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.abs().mean())
    return policy


def test_vllm_samples_with_the_log_probs_of_the_trainer_model(colocated, policy, prompts):
    colocated.push_policy(policy)
    rollout = colocated.generate(prompts, 4, SAMPLED, seed=1)
    assert rollout.completion_ids_BT.shape[0] == 16
    assert set(rollout.finish_reasons) <= {"eos", "length"}
    assert len({tuple(c) for c in completions(rollout)}) > 4  # samples, not one completion repeated
    gap = largest_logprob_gap(policy, prompts, rollout, num_generations=4)
    assert gap < 1e-3, f"vLLM's float32 log-probs differ from the trainer's by up to {gap:.3g}"
    again = colocated.generate(prompts, 4, SAMPLED, seed=1)
    assert completions(again) == completions(rollout)  # a seed draws the same samples
    assert completions(colocated.generate(prompts, 4, SAMPLED, seed=2)) != completions(rollout)


def test_greedy_sampling_gives_the_trainer_models_greedy_output(colocated, policy, prompts, default_tokenizer):
    colocated.push_policy(policy)
    rollout = colocated.generate(prompts, 3, GREEDY)  # vLLM refuses n > 1 greedy: sampled once, repeated
    assert completions(rollout)[0::3] == completions(rollout)[1::3] == completions(rollout)[2::3]
    one_each = colocated.generate(prompts, 1, GREEDY)
    assert_greedy_of(policy, prompts, one_each, [default_tokenizer.eos_token_id])


def test_a_pushed_full_fine_tune_takes_effect(colocated, policy, prompts, default_tokenizer):
    eos = [default_tokenizer.eos_token_id]
    colocated.push_policy(policy)
    before = completions(colocated.generate(prompts, 1, GREEDY))
    colocated.policy_changed(perturbed(policy))  # as after an optimizer step: pushed at the next generate
    after = colocated.generate(prompts, 1, GREEDY)
    assert completions(after) != before, "the perturbation did not change any greedy completion"
    assert_greedy_of(policy, prompts, after, eos)
    gap = largest_logprob_gap(policy, prompts, colocated.generate(prompts, 2, SAMPLED, seed=3), 2)
    assert gap < 1e-3, f"after the push vLLM's log-probs differ from the trainer's by up to {gap:.3g}"


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj", "o_proj"]])
def test_a_pushed_lora_policy_takes_effect_as_merged_weights(colocated, policy, prompts, default_tokenizer, targets):
    eos = [default_tokenizer.eos_token_id]
    colocated.push_policy(policy)
    before = completions(colocated.generate(prompts, 1, GREEDY))
    lora = trained_lora(policy, targets, r=4)
    colocated.push_policy(lora)
    after = colocated.generate(prompts, 1, GREEDY)
    assert completions(after) != before, "the adapter did not change any greedy completion"
    assert_greedy_of(lora, prompts, after, eos)


def test_a_training_run_samples_with_vllm_and_keeps_it_up_to_date(colocated, model_folder, tmp_path, prompts,
                                                                   default_tokenizer):
    """A short run on the default task, sampling with the colocated vLLM: every step's batch comes
    from it (the engine/trainer correction reads its log-probs), and at the end it holds the trained
    weights. That the default task is learned through vLLM is shown by the learning benchmark."""
    args = GRPOConfig.demo(model=model_folder, output_dir=str(tmp_path / "run"), max_steps=3, num_generations=4,
                      per_device_train_batch_size=8, max_completion_length=48, learning_rate=2e-5,
                      eval_max_samples=4, rollout_engine="vllm", seed=0, log_completions=False)
    trainer = GRPOTrainer(args=args, rollout_engine=colocated, quiet=True)
    trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:  # vLLM's log-probs are close to the trainer's: the correction weights are near 1
        assert 0.9 < m["engine_is/mean_weight"] < 1.1 and m["engine_is/masked_fraction"] < 0.1, m
    trained = trainer.model.eval()
    assert_greedy_of(trained, prompts, colocated.generate(prompts, 1, GREEDY), [default_tokenizer.eos_token_id])


def test_an_async_run_samples_ahead_with_vllm_and_leaves_it_holding_the_trained_policy(colocated, model_folder,
                                                                                       tmp_path, prompts,
                                                                                       default_tokenizer):
    """async_generation with the colocated vLLM: the worker samples each round one round behind, from
    its own thread, into the one vLLM; every row is corrected for the older policy; once training ends
    vLLM samples with the trained policy."""
    args = GRPOConfig.demo(model=model_folder, output_dir=str(tmp_path / "run"), max_steps=3, num_generations=4,
                      per_device_train_batch_size=8, max_completion_length=32, learning_rate=2e-5,
                      eval_max_samples=0, rollout_engine="vllm", seed=0, log_completions=False,
                      async_generation=True)
    trainer = GRPOTrainer(args=args, rollout_engine=colocated, quiet=True)
    trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["async/staleness"] for m in metrics] == [0.0, 1.0, 1.0]
    for m in metrics:  # an older policy and vLLM's kernels: still close, the weights near 1
        assert 0.8 < m["engine_is/mean_weight"] < 1.2 and m["engine_is/masked_fraction"] < 0.2, m
    trained = trainer.model.eval()
    assert_greedy_of(trained, prompts, colocated.generate(prompts, 1, GREEDY), [default_tokenizer.eos_token_id])


def test_the_engine_leaves_no_process_group_variables_for_processes_started_later(colocated):
    # a child process inheriting MASTER_PORT would try to listen on the port this engine holds
    assert {key: os.environ.get(key) for key in PROCESS_GROUP_ENV} == ENV_AT_START


def test_sleep_mode_is_refused_where_vllm_has_none(colocated):
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        pytest.skip("this machine's vLLM has a sleep mode (benchmarks/device_check.py runs it on a GPU)")
    with pytest.raises(ConfigError, match="vllm_enable_sleep_mode: vLLM has no sleep mode on this machine's device"):
        check_vllm(sleep_mode=True)


def test_a_model_vllm_cannot_load_is_refused_before_the_run_starts(tmp_path, model_folder):
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    assert model_problem(model_folder) is None  # the default model (Llama) loads
    folder = tmp_path / "gpt-neo"
    GPTNeoForCausalLM(GPTNeoConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2,
                                   attention_types=[[["global"], 2]], max_position_embeddings=64)).save_pretrained(folder)
    args = GRPOConfig.demo(model=str(folder), output_dir=str(tmp_path / "run"), rollout_engine="vllm")
    with pytest.raises(ConfigError, match=r"vLLM cannot load the model .*gpt-neo: its architecture "
                                          r"\(GPTNeoForCausalLM\).*use rollout_engine: fast"):
        GRPOTrainer(args=args, quiet=True)
    assert not (tmp_path / "run").exists()  # refused before the run folder is made
