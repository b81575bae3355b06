"""The variants wired through the trainer, on a tiny random Llama."""

import math
import re
import dataclasses
import json
import warnings

import pytest
import torch
import yaml

from covey import GRPOConfig, GRPOTrainer, core
from covey.train import update
from covey.train.batch import Update
from covey.train.metrics import step_metrics
from covey.cli import main
from covey.errors import ConfigError
from covey.models import add_lora, load_policy
from covey.rewards import SoftOverlongPenalty, load_reward_func
from covey.rollout import HFEngine
from tests.conftest import make_model, optimize, scored_batch
from tests.test_trainer import ROWS, count_a, small_args


def trainer_for(tmp_path, tokenizer, seed=0, **overrides):
    args = small_args(tmp_path, eval_max_samples=0, **overrides)
    return GRPOTrainer(model=make_model(len(tokenizer), seed=seed), reward_funcs=[count_a], args=args,
                       train_dataset=ROWS, processing_class=tokenizer, quiet=True)


def test_steps_per_generation_gives_several_optimizer_steps_with_old_logprobs_computed_once(tmp_path, tokenizer,
                                                                                            monkeypatch):
    trainer = trainer_for(tmp_path, tokenizer, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                          steps_per_generation=2, max_steps=2)
    calls = []
    original = update.logprobs_no_grad
    monkeypatch.setattr(update, "logprobs_no_grad", lambda parts, model, seq: calls.append(1) or original(parts, model, seq))
    ratios = []
    real_loss = core.policy_loss

    def spy(logp, old, *args, **kwargs):
        ratios.append(torch.exp(logp.detach() - old))
        return real_loss(logp, old, *args, **kwargs)

    core.policy_loss, saved = spy, core.policy_loss
    try:
        trainer.train()
    finally:
        core.policy_loss = saved
    assert trainer.global_step == 2 and trainer.progress.rounds_sampled == 1 and len(calls) == 1
    assert torch.equal(ratios[0], torch.ones_like(ratios[0]))  # first pass: ratio exactly 1
    assert not torch.allclose(ratios[1], torch.ones_like(ratios[1]))  # the second window sees a moved policy


def test_num_iterations_reuses_the_generation_batch(tmp_path, tokenizer):
    trainer = trainer_for(tmp_path, tokenizer, num_iterations=3, max_steps=3)
    trainer.train()
    assert trainer.global_step == 3 and trainer.progress.rounds_sampled == 1


def test_dynamic_sampling_drops_constant_groups_and_refills(tmp_path, tokenizer):
    def only_first_prompt_varies(prompts, completions, **kwargs):
        return [float(len(c[0]["content"]) % 3) if p[0]["content"] == "say a" else 1.0
                for p, c in zip(prompts, completions)]

    args = small_args(tmp_path, eval_max_samples=0, dynamic_sampling=True, dynamic_sampling_max_rounds=3, max_steps=1)
    trainer = GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[only_first_prompt_varies], args=args,
                          train_dataset=ROWS, processing_class=tokenizer, quiet=True)
    trainer.train()
    stats = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert stats["dynamic_sampling/extra_rounds"] == 3  # never two informative groups: the cap stops it
    assert stats["dynamic_sampling/dropped_groups"] >= 6
    assert stats["frac_reward_zero_std"] == 0.0  # what was trained on has signal


def test_mask_truncated_completions_leaves_them_out_of_the_loss(tmp_path, tokenizer):
    trainer = trainer_for(tmp_path, tokenizer, mask_truncated_completions=True, max_completion_length=3)
    samples = scored_batch(trainer, [0, 1])[0].samples
    for row, reason in enumerate(samples.finish_reasons):
        assert bool(samples.loss_mask_BT[row].any()) == (reason == "eos")
    assert "length" in samples.finish_reasons


def test_reference_sync_mixes_policy_into_reference(tmp_path, tokenizer):
    trainer = trainer_for(tmp_path, tokenizer, beta=0.1, sync_ref_model=True, ref_model_sync_steps=1,
                          ref_model_mixup_alpha=0.5, max_steps=1)
    ref_before = {n: p.clone() for n, p in trainer.reference.frozen.named_parameters()}
    trainer.train()
    for name, param in trainer.model.named_parameters():
        assert torch.allclose(trainer.reference.frozen.get_parameter(name), 0.5 * param + 0.5 * ref_before[name])


def test_reference_sync_is_refused_for_every_kind_of_lora_policy(tmp_path, tokenizer, tiny_model_dir):
    """A LoRA policy's reference is its base with the adapter off: nothing to sync. Refused whether the
    adapter comes from peft_config, from the model passed in, or from a saved adapter folder."""
    from peft import LoraConfig

    args = small_args(tmp_path, eval_max_samples=0, beta=0.1, sync_ref_model=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    adapted = add_lora(load_policy(str(tiny_model_dir)), 4, 8, 0.0, ["q_proj", "v_proj"])
    adapted.save_pretrained(tmp_path / "adapter")
    for model, peft_config in ((make_model(len(tokenizer)), lora), (adapted, None), (str(tmp_path / "adapter"), None)):
        with pytest.raises(ConfigError, match="sync_ref_model cannot be used with a LoRA policy"):
            GRPOTrainer(model=model, reward_funcs=[count_a], args=args, train_dataset=ROWS, processing_class=tokenizer,
                        peft_config=peft_config, quiet=True)


def test_lora_targets_that_the_model_lacks_are_named_with_the_ones_it_has(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match=r"lora_target_modules \['nosuch_proj'\] do not fit .* down_proj, .*q_proj"):
        trainer_for(tmp_path, tokenizer, use_peft=True, lora_target_modules=["nosuch_proj"])


@pytest.mark.parametrize("target, warned", [("lm_head", True), ("embed_tokens", True), ("v_proj", False)])
def test_an_adapter_on_a_shared_embedding_matrix_warns_what_cannot_hold_it(tmp_path, tokenizer, target, warned):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_for(tmp_path, tokenizer, use_peft=True, lora_target_modules=["q_proj", target])
    said = [str(w.message) for w in caught if "covey export gives a model with the two untied" in str(w.message)]
    assert bool(said) == warned and all(f"leave {target} out" in text for text in said)


def test_no_reference_model_when_beta_is_zero(tmp_path, tokenizer):
    assert trainer_for(tmp_path, tokenizer, beta=0.0).reference is None


def test_soft_overlong_penalty_matches_dapo():
    penalty = SoftOverlongPenalty(max_length=10, cache_length=4)
    assert penalty(completion_ids=[[1] * 6, [1] * 8, [1] * 10, [1] * 11]) == [0.0, -0.5, -1.0, -1.0]
    built_in = load_reward_func("soft_overlong_penalty", {"soft_overlong_penalty": {"max_length": 8, "cache_length": 2}})
    assert built_in(completion_ids=[[1] * 7]) == [-0.5]


class InexactEngine(HFEngine):
    """An engine whose log-probs are off from the trainer's (as bf16 kernels or vLLM are)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exact_logprobs = False

    def generate(self, *args, **kwargs):
        rollout = super().generate(*args, **kwargs)
        return dataclasses.replace(rollout, sampling_logp_BT=rollout.sampling_logp_BT - 0.05 * rollout.completion_mask_BT)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_engine_mismatch_is_corrected_when_the_engine_is_not_exact(tmp_path, tokenizer, mode, num_iterations,
                                                                    monkeypatch):
    model = make_model(len(tokenizer))
    args = small_args(tmp_path, eval_max_samples=0, max_steps=1, vllm_importance_sampling_mode=mode,
                      vllm_importance_sampling_clip_max=1.5, num_iterations=num_iterations)
    engine = InexactEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    trainer = GRPOTrainer(model=model, reward_funcs=[count_a], args=args, train_dataset=ROWS,
                          processing_class=tokenizer, rollout_engine=engine, quiet=True)
    batch, fixed = scored_batch(trainer, [0, 1])
    samples = batch.samples
    sampler_logp_BT = update.logprobs_no_grad(trainer.parts, trainer.model, samples.sequences)  # the policy that sampled
    expected = core.engine_importance_weights(sampler_logp_BT, samples.sampling_logp_BT, samples.loss_mask_BT.float(),
                                              core.EngineCorrection.from_mode(mode, 1.5))
    used = []  # the weights each micro-batch's loss was given
    real_loss = core.policy_loss
    monkeypatch.setattr(core, "policy_loss", lambda *a, **k: used.append(a[8]) or real_loss(*a, **k))
    if num_iterations == 1:  # the policy does not move before it trains: the training forward gives the weights
        assert fixed.old_BT is None and fixed.correction is not None and fixed.engine_weights is None
        stats = optimize(trainer, batch, fixed)
    else:  # a separate pass before the policy moves
        assert fixed.old_BT is not None and fixed.engine_weights is not None
        assert torch.allclose(fixed.engine_weights, expected, atol=1e-5)
        stats = optimize(trainer, batch, fixed)
    first = 0
    for weights in used:
        assert torch.allclose(weights.cpu(), expected[first:first + len(weights), :weights.shape[1]], atol=1e-5)
        first += len(weights)
    assert first == samples.size
    token_w = torch.exp(sampler_logp_BT - samples.sampling_logp_BT)[samples.loss_mask_BT == 1]
    assert torch.allclose(token_w, torch.full_like(token_w, torch.exp(torch.tensor(0.05)).item()), atol=1e-4)
    if mode == "token_truncate":  # logged over the trained tokens only, each weighing exp(0.05)
        one_step = Update(1, stats, stats["grad_norm"], 1e-3, 0, {"time/generate": 0.0, "time/score": 0.0}, 1.0, 1.0)
        metrics = step_metrics(batch, one_step, ["count_a"], torch.ones(1, dtype=torch.float64), {}, {}, 0)
        assert metrics["engine_is/mean_weight"] == pytest.approx(torch.exp(torch.tensor(0.05)).item(), abs=1e-4)
        assert metrics["engine_is/masked_fraction"] == 0.0


def test_bf16_sampling_trains_with_the_correction_and_no_extra_pass(tmp_path, tokenizer, monkeypatch):
    trainer = trainer_for(tmp_path, tokenizer, rollout_bf16=True, max_steps=2)
    assert trainer.engine.exact_logprobs is False
    passes = []
    monkeypatch.setattr(update, "logprobs_no_grad", lambda *a, **k: passes.append(1))  # the separate scoring pass
    trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and not passes
    for m in metrics:  # bfloat16 sampling of a float32 policy: weights near 1 but not 1 (computed, not the fill)
        assert 0.5 < m["engine_is/mean_weight"] < 1.5 and m["engine_is/mean_weight"] != 1.0
        assert m["engine_is/masked_fraction"] < 0.5


def test_exact_engine_needs_no_correction(tmp_path, tokenizer):
    _, fixed = scored_batch(trainer_for(tmp_path, tokenizer), [0, 1])
    assert fixed.engine_weights is None and fixed.correction is None and fixed.old_BT is None


TRL_STYLE = """
# a config written for TRL's GRPOTrainer, with TRL's field names
learning_rate: 1.0e-4
per_device_train_batch_size: 4
gradient_accumulation_steps: 2
steps_per_generation: 4
num_generations: 4
max_completion_length: 6
num_iterations: 2
beta: 0.04
epsilon: 0.2
epsilon_high: 0.28
delta: 2.0
loss_type: dr_grpo
scale_rewards: none
multi_objective_aggregation: sum_then_normalize
importance_sampling_level: token
mask_truncated_completions: true
top_entropy_quantile: 0.8
use_bias_correction_kl: true
sync_ref_model: true
ref_model_mixup_alpha: 0.9
ref_model_sync_steps: 2
temperature: 0.9
top_p: 0.95
top_k: 20
max_grad_norm: 1.0
warmup_ratio: 0.1
lr_scheduler_type: cosine
adam_beta1: 0.9
adam_beta2: 0.99
weight_decay: 0.01
seed: 7
max_steps: 4
logging_steps: 2
logging_first_step: true
log_completions: true
bf16: false
gradient_checkpointing: false
"""


def test_a_trl_style_config_runs_unchanged(tmp_path, tiny_model_dir):
    config = tmp_path / "trl.yaml"
    config.write_text(TRL_STYLE + f"model: {tiny_model_dir}\ndataset: arithmetic\nreward_funcs: [answer_format]\n"
                                  f"eval_max_samples: 2\noutput_dir: {tmp_path / 'run'}\n")
    assert main(["train", str(config)]) == 0
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    for key, value in yaml.safe_load(TRL_STYLE).items():
        assert saved[key] == value, key
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 4]  # logging_first_step, then every logging_steps


@pytest.mark.parametrize("field, value, covey_does", [("optim", "sgd", "'adamw_torch_fused'"),
                                                      ("logging_nan_inf_filter", "false", "True"),
                                                      ("train_sampling_strategy", "sequential", "'random'")])
def test_trl_fields_at_values_covey_cannot_honour_are_refused_alike_in_yaml_and_python(tmp_path, field, value,
                                                                                       covey_does):
    config = tmp_path / "c.yaml"
    config.write_text(f"{field}: {value}\n")
    message = f"is a TRL setting covey does not support (covey works as {field}: {covey_does}"
    with pytest.raises(ConfigError, match=re.escape(message)):
        GRPOConfig.from_yaml(config)
    with pytest.raises(ConfigError, match=re.escape(message)):
        GRPOConfig(**{field: yaml.safe_load(value)})
    assert getattr(GRPOConfig(**{field: yaml.safe_load(covey_does.strip("'"))}), field) == yaml.safe_load(
        covey_does.strip("'"))  # TRL's default is accepted, and reads back


# settings TRL recipes write whose values are what covey does anyway
AS_COVEY_DOES = """\
optim: adamw_torch
logging_strategy: steps
save_strategy: steps
eval_strategy: no  # YAML reads an unquoted no as false
do_eval: false
push_to_hub: false
hub_model_id: someone/some-model
hub_strategy: every_save
remove_unused_columns: false
gradient_checkpointing_kwargs:
  use_reentrant: false
"""


def test_trl_settings_that_describe_what_covey_does_are_accepted(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(AS_COVEY_DOES + "learning_rate: 3.0e-6\n")
    assert GRPOConfig.from_yaml(config, overrides={"torch_compile": "false"}).learning_rate == 3.0e-6


@pytest.mark.parametrize("setting, message", [
    ("logging_strategy: epoch", "logging_strategy: 'epoch' is a TRL setting covey does not support \\(covey works as logging_strategy: 'steps'\\)"),
    ("optim: adamw_8bit", "optim: 'adamw_8bit' is a TRL setting .* 'adamw_torch_fused' or 'adamw_torch'"),
    ("eval_strategy: epoch", "eval_strategy='epoch' is not one of no, steps"),
    ("gradient_checkpointing_kwargs: {use_reentrant: true}", "gradient_checkpointing_kwargs: .*use_reentrant.*True"),
    ("do_train: 1", "do_train: 1 is a TRL setting"),  # a number is not the boolean it looks like
])
def test_trl_settings_that_ask_for_something_else_are_refused(tmp_path, setting, message):
    config = tmp_path / "c.yaml"
    config.write_text(setting + "\n")
    with pytest.raises(ConfigError, match=message):
        GRPOConfig.from_yaml(config)


@pytest.mark.parametrize("values, message", [
    (dict(steps_per_generation=3, gradient_accumulation_steps=2, per_device_train_batch_size=8), "multiple of gradient_accumulation_steps"),
    (dict(delta=1.1), "delta=1.1 must exceed 1 \\+ epsilon_high"),
    (dict(clip_ratio_c=0.5), "clip_ratio_c"),
    (dict(sync_ref_model=True), "sync_ref_model needs beta > 0"),
    (dict(top_entropy_quantile=0), "top_entropy_quantile"),
    (dict(use_peft=True, lora_target_modules=[]), "lora_target_modules is empty"),
    (dict(seed=10**20), "seed=100000000000000000000 is too large"),
    (dict(use_vllm=True, seed=-1), "vLLM takes seeds from 0 to 2\\*\\*32 - 1"),
])
def test_incompatible_variant_settings(values, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**values)


def test_save_strategy_takes_trls_values_only(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("save_strategy: best\n")
    with pytest.raises(ConfigError, match="save_strategy='best' is not one of steps, epoch, no"):
        GRPOConfig.from_yaml(config)


def test_use_cpu_keeps_the_models_on_the_cpu_where_a_gpu_is(monkeypatch, tmp_path, tiny_model_dir):
    from covey.models import default_device
    from covey.train.setup import build_policy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    assert default_device() == torch.device("cuda") and default_device(use_cpu=True) == torch.device("cpu")
    moved = []
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(a) or self)
    build_policy(GRPOConfig(model=str(tiny_model_dir), use_cpu=True, bf16=False), None, None)
    build_policy(GRPOConfig(model=str(tiny_model_dir), bf16=False), None, None)  # the GPU here is make-believe
    assert moved == [(torch.device("cpu"),), (torch.device("cuda"),)]


@pytest.mark.parametrize("variant", [
    dict(loss_type="sapo"),
    dict(loss_type="sapo", importance_sampling_level="sequence", num_iterations=2),
    dict(loss_type="vespo", num_iterations=2),
    dict(off_policy_mask_threshold=0.01, num_iterations=2),
    dict(entropy_coef=0.05),
    dict(use_adaptive_entropy=True, entropy_target=50.0, entropy_coef_delta=0.01),
], ids=["sapo", "sapo-sequence", "vespo", "off-policy-mask", "entropy-bonus", "adaptive-entropy"])
def test_the_newer_losses_and_controls_train(tmp_path, tokenizer, variant):
    trainer = trainer_for(tmp_path, tokenizer, max_steps=2, **variant)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # finite (a NaN is written as null, which would fail isinstance)
    assert len(metrics) == 2 and all(isinstance(m["loss"], float) and math.isfinite(m["loss"]) for m in metrics)
    soft = variant.get("loss_type") in ("sapo", "vespo")
    assert ("clip_ratio/region_mean" in metrics[0]) == (not soft)  # a soft weight clips nothing
    if variant.get("loss_type") == "vespo":  # on policy W = 1 and phi(1) = 1 exactly; then the policy has moved
        assert metrics[0]["vespo/phi_seq_mean"] == 1.0 and metrics[1]["vespo/phi_seq_mean"] != 1.0
    if "off_policy_mask_threshold" in variant:
        # the first step is on-policy: no drift, nothing masked; the second measures a moved policy
        assert metrics[0]["off_policy_mask/masked_fraction"] == 0.0
        assert isinstance(metrics[1]["off_policy_mask/masked_fraction"], float)
    if "entropy_coef" in variant:
        assert [m["entropy_coef"] for m in metrics] == [0.05, 0.05]
    if variant.get("use_adaptive_entropy"):  # the entropy is below the target: the coefficient rises each step
        assert [m["entropy_coef"] for m in metrics] == pytest.approx([0.01, 0.02])
        assert trainer.progress.entropy_coef == pytest.approx(0.02) and trainer.progress.last_entropy < 50.0


def test_the_entropy_bonus_gradient_reaches_the_weights(tmp_path, tokenizer):
    """With every reward equal the policy term is 0: only the bonus's gradient can move the weights."""
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    def run(folder, **settings):
        args = small_args(folder, eval_max_samples=0, max_steps=1, **settings)
        trainer = GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[constant], args=args,
                              train_dataset=ROWS, processing_class=tokenizer, quiet=True)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        return sum(float((p.detach() - before[n]).abs().sum()) for n, p in trainer.model.named_parameters())

    assert run(tmp_path / "plain") == 0.0
    assert run(tmp_path / "bonus", entropy_coef=0.5) > 0.0


def test_vespo_with_a_sequence_level_engine_correction_is_refused_for_an_inexact_engine(tmp_path, tokenizer):
    model = make_model(len(tokenizer))
    engine = InexactEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    for mode, refused in (("sequence_mask", True), ("token_truncate", False)):
        args = small_args(tmp_path / mode, eval_max_samples=0, max_steps=1, loss_type="vespo",
                          vllm_importance_sampling_mode=mode)
        make = lambda: GRPOTrainer(model=model, reward_funcs=[count_a], args=args, train_dataset=ROWS,  # noqa: E731
                                   processing_class=tokenizer, rollout_engine=engine, quiet=True)
        if refused:
            with pytest.raises(ConfigError, match="set vllm_importance_sampling_mode: token_truncate or token_mask"):
                make()
        else:
            make().train()


@pytest.mark.parametrize("exact", [True, False])
def test_the_off_policy_mask_measures_drift_from_the_policy_that_sampled(tmp_path, tokenizer, monkeypatch, exact):
    """An exact engine: from the old log-probs (as TRL without vLLM); an inexact one: from the engine's
    own sampling log-probs (as TRL with vLLM), so the engine's drift counts too."""
    model = make_model(len(tokenizer))
    args = small_args(tmp_path, eval_max_samples=0, max_steps=1, off_policy_mask_threshold=0.5)
    engine = (HFEngine if exact else InexactEngine)(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    trainer = GRPOTrainer(model=model, reward_funcs=[count_a], args=args, train_dataset=ROWS,
                          processing_class=tokenizer, rollout_engine=engine, quiet=True)
    batch, fixed = scored_batch(trainer, [0, 1])
    seen = []  # (old, behaviour) of each micro-batch
    real_loss = core.policy_loss
    monkeypatch.setattr(core, "policy_loss", lambda *a, **k: seen.append((a[1], a[9])) or real_loss(*a, **k))
    optimize(trainer, batch, fixed)
    first = 0
    for old, behaviour in seen:
        sampling = batch.samples.sampling_logp_BT[first:first + len(old), :old.shape[1]]
        assert torch.equal(behaviour, old) if exact else torch.equal(behaviour.cpu(), sampling)
        first += len(old)
    assert first == batch.samples.size


def test_gradient_checkpointing_under_bf16_autocast_recomputes_the_same_attention(tmp_path, tokenizer):
    """The checkpointed layers recompute their forward in the backward: the attention must run as it did."""
    trainer = trainer_for(tmp_path, tokenizer, bf16=True, gradient_checkpointing=True, max_steps=1)
    trainer.train()
    assert trainer.global_step == 1 and math.isfinite(trainer.history[-1]["loss"])
