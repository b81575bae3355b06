"""TRL code moves across by its import alone: GRPOConfig in Python takes TRL's fields and rules, the trainer
exposes what TRL's GRPOTrainer and transformers' Trainer do, and refuses what TRL refuses."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.errors import ConfigError
from covey.train.trl_api import training_loss
from tests.conftest import loss_settings
from tests.test_trainer import ROWS, count_a, small_args


def test_python_s_door_takes_every_training_argument_trl_does_and_refuses_others_in_one_line():
    from trl import GRPOConfig as TRLConfig

    import dataclasses

    trl_defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                    for f in dataclasses.fields(TRLConfig) if f.init}
    config = GRPOConfig(**trl_defaults)  # a saved TRL config lists every field at TRL's default
    assert (config.max_steps, config.num_train_epochs, config.learning_rate) == (-1, 3.0, 1e-6)
    assert config.optim == "adamw_torch_fused" and config.do_eval is False  # read back as given
    assert GRPOConfig(eval_on_start=True, log_on_each_node=False, use_liger_kernel=False).eval_on_start is True
    with pytest.raises(ConfigError) as caught:
        GRPOConfig(optim="adamw_8bit", dataloader_drop_last=True, lr=1e-5)
    assert caught.value.problems == [
        "optim: 'adamw_8bit' is a TRL setting covey does not support (covey works as optim: 'adamw_torch_fused' or "
        "'adamw_torch'); remove it",
        "dataloader_drop_last: True is a TRL setting covey does not support (covey works as dataloader_drop_last: "
        "False); remove it",
        "unknown config key 'lr' (covey's name for it: learning_rate)"]
    assert GRPOConfig("runs/x").output_dir == "runs/x"  # TrainingArguments' one positional argument


def test_train_returns_trl_s_output_and_closes_the_log_history(tmp_path, tokenizer, tiny_model):
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=count_a, train_dataset=ROWS, processing_class=tokenizer,
                          args=small_args(tmp_path, max_steps=3, logging_steps=2, eval_max_samples=0), quiet=True)
    output = trainer.train()
    closing = trainer.state.log_history[-1]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == [2, 3]
    # the mean over the three steps: the entry at step 2 covers two of them
    assert output.training_loss == closing["train_loss"] == pytest.approx(
        (2 * logged[0]["loss"] + logged[1]["loss"]) / 3)
    assert output.global_step == closing["step"] == 3 and output.metrics["train_runtime"] > 0
    assert closing["reward"] == logged[-1]["reward"]  # the last step's metrics too, as TRL's closing entry has
    assert set(output.metrics) == {"train_runtime", "train_samples_per_second", "train_steps_per_second",
                                   "total_flos", "train_loss"}
    assert trainer.summary["steps"] == 3  # what summary.json holds
    trainer.save_metrics("train", output.metrics)
    trainer.save_state()
    assert json.loads((tmp_path / "run" / "train_results.json").read_text())["train_loss"] == output.training_loss
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert state["log_history"][-1]["train_loss"] == output.training_loss and state["global_step"] == 3


def test_training_loss_weighs_each_logged_mean_by_its_steps_and_leaves_out_nan():
    history = [{"step": 2, "loss": 1.0}, {"step": 3, "loss": math.nan}, {"step": 6, "loss": 4.0}]
    assert training_loss(history, first_step=0) == pytest.approx((2 * 1.0 + 3 * 4.0) / 5)
    assert training_loss(history, first_step=3) == pytest.approx(4.0)  # a resumed call counts its own steps
    assert math.isnan(training_loss([], first_step=0))


def test_the_trainer_s_public_members_are_trl_s(tmp_path, tokenizer, tiny_model):
    def other(completions, **kwargs):
        return [1.0] * len(completions)

    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[count_a, other], train_dataset=ROWS, processing_class=tokenizer,
                          eval_dataset={"first": ROWS[:2], "second": ROWS[2:5]},
                          args=small_args(tmp_path, max_steps=1, beta=0.1, reward_weights=[2.0, 0.5]), quiet=True)
    assert trainer.reward_funcs == [count_a, other] and trainer.reward_func_names == ["count_a", "other"]
    assert trainer.reward_weights.tolist() == [2.0, 0.5] and trainer.reward_processing_classes == [None, None]
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    assert trainer.train_dataset is ROWS and set(trainer.eval_dataset) == {"first", "second"}
    assert trainer.is_world_process_zero() and trainer.tools == [] and trainer.entropy_coef == 0.0
    metrics = trainer.evaluate()  # both named sets, together
    assert metrics["eval_n"] == 4  # eval_max_samples=4 of the five rows
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] != 0
    metrics = trainer.evaluate(eval_dataset={"first": ROWS[:2], "second": ROWS[2:5]}, metric_key_prefix="test")
    assert (metrics["test_first_n"], metrics["test_second_n"]) == (2, 3) and "test_first_loss" in metrics
    assert trainer.state.log_history[-1]["test_second_n"] == 3  # logged as transformers logs it
    from datasets import Dataset, DatasetDict

    named = DatasetDict({"data1": Dataset.from_list(ROWS[:2])})  # as TRL's scripts split one
    assert trainer.evaluate(eval_dataset=named)["eval_data1_n"] == 2
    with pytest.raises(ConfigError, match="trainer.model cannot be replaced once the trainer is built"):
        trainer.model = torch.nn.Linear(2, 2)
    trainer.model = trainer.model  # the same model: nothing changes
    entropies, mask = torch.tensor([[0.1, 0.5, 0.9, 0.3]]), torch.tensor([[1, 1, 1, 0]])
    assert trainer.get_high_entropy_mask(entropies, mask, threshold=0.5).tolist() == [[False, True, True, False]]
    kept = GRPOTrainer.get_off_policy_mask(torch.tensor([[-1.0], [1.0]]), torch.zeros(2, 2), torch.ones(2, 2),
                                           torch.ones(2, 2), off_policy_threshold=0.5)
    assert kept.tolist() == [[0.0], [1.0]]  # a negative advantage that drifted is dropped


def test_data_and_rewards_are_needed_in_python_as_in_trl(tmp_path, tokenizer, tiny_model):
    with pytest.raises(ConfigError, match="`train_dataset` is required unless an `environment_factory` is provided"):
        GRPOTrainer(model=tiny_model, reward_funcs=count_a, args=small_args(tmp_path), processing_class=tokenizer)
    with pytest.raises(ConfigError, match="No reward source provided"):
        GRPOTrainer(model=tiny_model, train_dataset=ROWS, args=small_args(tmp_path), processing_class=tokenizer)
    # a config that names them (as a config file or the command line always does) fills them in
    trainer = GRPOTrainer(model=tiny_model, processing_class=tokenizer, quiet=True,
                          args=small_args(tmp_path, dataset="arithmetic", reward_funcs=["answer_format"]))
    assert trainer.reward_func_names == ["answer_format"] and trainer.run.dataset_name == "arithmetic"
    assert GRPOConfig.from_dict({}).fields_given >= {"dataset", "reward_funcs"}


def test_trl_s_warnings_are_given(tmp_path, tokenizer, tiny_model):
    with pytest.warns(UserWarning, match="weights each sequence by its completion length"):
        GRPOConfig(importance_sampling_level="sequence", loss_type="dapo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(importance_sampling_level="sequence", loss_type="grpo")  # GSPO's own objective: no warning
        GRPOConfig(importance_sampling_level="sequence", loss_type="luspo")

    def undefined_for_some(completions, **kwargs):
        return [None, *[1.0] * (len(completions) - 1)]

    trainer = GRPOTrainer(model=tiny_model, reward_funcs=undefined_for_some, train_dataset=ROWS,
                          processing_class=tokenizer, args=small_args(tmp_path, max_steps=1, eval_max_samples=0),
                          quiet=True)
    with pytest.warns(UserWarning, match="All reward functions returned None for the following kwargs"):
        trainer.train()


def test_luspo_weighs_each_sequence_s_loss_by_its_length():
    from covey import core

    logp, old = torch.log(torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.6, 0.1]])), torch.log(torch.full((2, 3), 0.4))
    mask, advantages = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]), torch.tensor([1.0, -1.0])
    counts = core.BatchCounts(sequences=2, tokens=4.0, micro_batches=1, max_completion_length=3)
    settings = loss_settings(loss_type="luspo", importance_sampling_level="sequence", epsilon_low=10.0,
                               epsilon_high=10.0)
    loss, _ = core.policy_loss(logp, old, advantages, mask, counts, settings)
    # unclipped: sequence i's loss is -s_i A_i at each of its tokens; LUSPO sums them, then means over sequences
    s = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1))
    assert loss.item() == pytest.approx(((-s * advantages) * mask.sum(1)).mean().item(), rel=1e-6)


def tiny_moe(vocab_size: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01)
    return Qwen3MoeForCausalLM(config)


def test_a_mixture_of_experts_model_trains_with_its_router_s_load_balancing_loss(tmp_path, tokenizer, tiny_model):
    args = small_args(tmp_path, max_steps=1, eval_max_samples=0, logging_steps=1)
    trainer = GRPOTrainer(model=tiny_moe(len(tokenizer)), reward_funcs=count_a, train_dataset=ROWS,
                          processing_class=tokenizer, args=args, quiet=True)
    assert trainer.aux_loss_enabled and trainer.parts.loss_settings.router_aux_loss_coef == 0.01  # the config's own
    trainer.train()
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["aux_loss"] > 0 and trainer.state.log_history[-1]["aux_loss"] == logged["aux_loss"]
    off = GRPOTrainer(model=tiny_moe(len(tokenizer)), reward_funcs=count_a, train_dataset=ROWS, processing_class=tokenizer,
                      args=small_args(tmp_path / "off", router_aux_loss_coef=0.0), quiet=True)
    assert not off.aux_loss_enabled
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.5 weighs .* is not a Mixture-of-Experts model"):
        GRPOTrainer(model=tiny_model, reward_funcs=count_a, train_dataset=ROWS, processing_class=tokenizer,
                    args=small_args(tmp_path / "dense", router_aux_loss_coef=0.5))


def test_the_router_loss_joins_the_policy_loss_as_its_mean_over_micro_batches():
    from covey import core

    logp = torch.log(torch.tensor([[0.5, 0.4]]))
    mask, advantages = torch.ones(1, 2), torch.tensor([1.0])
    counts = core.BatchCounts(sequences=2, tokens=4.0, micro_batches=2, max_completion_length=2)
    plain, _ = core.policy_loss(logp, logp.detach(), advantages, mask, counts, loss_settings())
    settings = loss_settings(router_aux_loss_coef=0.1)
    with_router, stats = core.policy_loss(logp, logp.detach(), advantages, mask, counts, settings,
                                          router_aux_loss=torch.tensor(3.0))
    assert with_router.item() == pytest.approx(plain.item() + 0.1 * 3.0 / 2)
    assert stats.aux_loss_sum == 3.0


def test_the_held_out_loss_is_the_grpo_loss_at_ratio_one(tmp_path, tokenizer, tiny_model):
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    trainer = GRPOTrainer(model=tiny_model, reward_funcs=constant, train_dataset=ROWS, processing_class=tokenizer,
                          eval_dataset=ROWS[:3], args=small_args(tmp_path, beta=0.1), quiet=True)
    # equal rewards give no advantage, and the reference is the policy itself before training: no KL
    assert trainer.evaluate()["eval_loss"] == 0.0
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert trainer.evaluate()["eval_loss"] > 0  # the KL term, once the policy moved from the reference


def test_a_hybrid_model_with_recurrent_layers_samples_and_trains(tmp_path, tokenizer):
    """Nemotron-H mixes Mamba, attention and expert layers: the fast sampler reorders its cache through
    reorder_cache (which every kind of layer has), and the training pass runs each row in full (a recurrent
    state cannot be shared the way a prompt's keys and values are)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from covey.train.forward import SequenceBatch, _has_recurrent_layers, completion_logprobs

    torch.manual_seed(0)
    config = NemotronHConfig(vocab_size=len(tokenizer), hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=32, layers_block_type=["mamba", "attention", "moe"], mamba_num_heads=8,
                             mamba_head_dim=4, mamba_n_groups=1, ssm_state_size=16, mamba_d_conv=4, mamba_expand=2,
                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             moe_shared_expert_intermediate_size=32, pad_token_id=tokenizer.pad_token_id)
    model = NemotronHForCausalLM(config)
    assert _has_recurrent_layers(model)
    trainer = GRPOTrainer(model=model, reward_funcs=count_a, train_dataset=ROWS, processing_class=tokenizer,
                          args=small_args(tmp_path, max_steps=1, eval_max_samples=0), quiet=True)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())
    # the same log-probs as every row run in full, without the shared-prompt pass
    batch = SequenceBatch(torch.tensor([[5, 6, 7], [5, 6, 7]]), torch.ones(2, 3, dtype=torch.long),
                          torch.tensor([[8, 9], [10, 11]]), torch.ones(2, 2, dtype=torch.long))
    shared, _ = completion_logprobs(model.eval(), batch)
    alone, _ = completion_logprobs(model, batch, share_prompt=False)
    torch.testing.assert_close(shared, alone)


def test_trl_s_asynchronous_config_and_trainer_are_covey_s_asynchronous_generation(tmp_path, tokenizer, tiny_model):
    from covey import AsyncGRPOConfig, AsyncGRPOTrainer

    config = AsyncGRPOConfig(output_dir=str(tmp_path / "a"), vllm_server_base_url="http://127.0.0.1:8011",
                             weight_sync_steps=1, queue_maxsize=1024)
    assert (config.async_generation, config.rollout_engine, config.vllm_mode, config.max_staleness) == (
        True, "vllm", "server", 4)  # TRL's defaults: a vLLM server, four steps of staleness
    assert (config.vllm_server_host, config.vllm_server_port) == ("127.0.0.1", 8011)
    with pytest.raises(ConfigError, match="weight_sync_steps: 4 is a TRL setting covey does not support"):
        AsyncGRPOConfig(weight_sync_steps=4)  # covey's worker takes the new weights after every round
    # any engine can sample ahead: the fast one here
    args = AsyncGRPOConfig(**{**small_args(tmp_path, max_steps=2, eval_max_samples=0).to_dict(), "use_vllm": False, "async_generation": True,
                              "rollout_engine": "fast", "max_staleness": 1})
    trainer = AsyncGRPOTrainer(model=tiny_model, reward_funcs=count_a, args=args, train_dataset=ROWS,
                               processing_class=tokenizer, quiet=True)
    assert trainer.train().global_step == 2
    with pytest.raises(ConfigError, match="AsyncGRPOTrainer trains while the next rounds are generated"):
        AsyncGRPOTrainer(model=tiny_model, reward_funcs=count_a, args=small_args(tmp_path / "s"), train_dataset=ROWS,
                         processing_class=tokenizer)


@pytest.mark.skipif(__import__("importlib").util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
def test_a_script_s_own_4bit_model_with_an_adapter_trains_as_trl_scripts_build_it(tmp_path, tokenizer):
    """The QLoRA notebooks' form: the script loads in 4 bits itself (BitsAndBytesConfig), prepares the model
    for k-bit training, adds the adapter with get_peft_model, and hands the PeftModel over."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))
    model = get_peft_model(prepare_model_for_kbit_training(model),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = GRPOConfig(**{**small_args(tmp_path, max_steps=1, eval_max_samples=0).to_dict(), "optim": "adamw_torch",
                         "log_on_each_node": False, "bf16": True, "gradient_checkpointing": True})
    trainer = GRPOTrainer(model=model, reward_funcs=count_a, args=args, train_dataset=ROWS, processing_class=tokenizer,
                          quiet=True)
    trainer.train()
    assert any(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in adapter.items())
    assert (tmp_path / "run" / "final_model" / "adapter_config.json").is_file()


def test_a_model_without_its_tokenizer_is_refused_not_paired_with_the_default(tmp_path, tokenizer):
    from tests.conftest import make_model

    nameless = make_model(len(tokenizer))
    nameless.config._name_or_path = ""
    with pytest.raises(ConfigError, match="the model object has no name or folder to load its tokenizer from"):
        GRPOTrainer(model=nameless, reward_funcs=count_a, train_dataset=ROWS, args=small_args(tmp_path))
    small = make_model(len(tokenizer) - 10)
    with pytest.raises(ConfigError, match=rf"the tokenizer has {len(tokenizer)} tokens and the model's embedding only "
                                          rf"{len(tokenizer) - 10} rows"):
        GRPOTrainer(model=small, reward_funcs=count_a, train_dataset=ROWS, args=small_args(tmp_path / "b"),
                    processing_class=tokenizer)
