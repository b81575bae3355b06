"""End to end on a tiny random Llama built in the test: no download, seconds per run."""

import importlib.util
import json
import re
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
import yaml

from covey import GRPOConfig, GRPOTrainer
from covey.errors import ConfigError, DataError, ModelError, RewardError
import covey.train.step as step_module
from covey.train.setup import lr_schedule
from covey.train.update import logprobs_no_grad
from tests.conftest import SMALL_RUN, make_model, make_tokenizer, optimize, scored_batch

ROWS = [{"prompt": [{"role": "user", "content": f"say {c}"}], "answer": str(i)} for i, c in enumerate("abcdefgh")]


def count_a(completions, **kwargs):
    """Varies from sample to sample even for a random model: distinct characters, 'a' counting double."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(len(set(t)) + t.count("a")) / 8 for t in texts]


def small_args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=4, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, max_completion_length=8, learning_rate=1e-3, eval_max_samples=4)
    values = {**SMALL_RUN, **values}  # what the run relies on beyond its sizes
    values.update(overrides)
    return GRPOConfig(**values)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trains_writes_the_run_folder_and_saves_a_loadable_model(tmp_path, tokenizer, tiny_model):
    args = small_args(tmp_path, beta=0.04, num_iterations=2, max_steps=3, reward_weights=[2.0])
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=args, train_dataset=ROWS,
                          eval_dataset=ROWS, processing_class=tokenizer, quiet=True)
    before = _snapshot(trainer.model)
    trainer.train()
    summary = trainer.summary
    after = _snapshot(trainer.model)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert trainer.reference is not None and all(
        torch.equal(before[n], p) for n, p in trainer.reference.frozen.named_parameters())

    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for key in ("reward", "reward_std", "rewards/count_a/mean", "frac_reward_zero_std", "kl", "loss", "entropy",
                "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean", "step_time",
                "learning_rate", "grad_norm"):
        assert key in metrics[0], key
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first step
    completions = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(completions) == 2 * 8 and {"prompt", "completion", "rewards", "advantage"} <= set(completions[0])
    given = ("model", "dataset", "eval_dataset", "reward_funcs")  # handed to the trainer: see the test below
    saved_config = GRPOConfig.from_yaml(run / "config.yaml").to_dict()
    assert {k: v for k, v in saved_config.items() if k not in given} == {
        k: v for k, v in args.to_dict().items() if k not in given}
    saved = json.loads((run / "summary.json").read_text())
    assert saved["steps"] == 3 and saved["before"]["n"] == 4 and "accuracy" in saved["after"]
    assert summary["final_model"] == str(run / "final_model")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    card = (run / "final_model" / "README.md").read_text()
    assert card.startswith("---") and "| count_a | 2 |" in card and "| beta | 0.04 |" in card
    assert f"| before | {100 * saved['before']['accuracy']:.1f}%" in card
    reloaded = AutoModelForCausalLM.from_pretrained(run / "final_model")
    for name, p in reloaded.named_parameters():
        assert torch.equal(p, after[name]), name
    assert AutoTokenizer.from_pretrained(run / "final_model").chat_template


@pytest.mark.parametrize("fsdp", ["", "full_shard"])
def test_every_log_prob_pass_of_a_run_takes_its_budget(tmp_path, tokenizer, tiny_model, monkeypatch, fsdp):
    """The training pass, the old policy's and the reference's all run the head within logprob_budget_mib,
    plain or as a sharded run's passes (``fsdp``, here in one process)."""
    import covey.train.forward as forward

    seen = []

    def head_logprobs(*args, budget=None, **kwargs):
        seen.append((budget, torch.is_grad_enabled()))
        return original(*args, budget=budget, **kwargs)

    original = forward.head_logprobs
    monkeypatch.setattr(forward, "head_logprobs", head_logprobs)
    args = small_args(tmp_path, beta=0.04, num_iterations=2, max_steps=2, logprob_budget_mib=3, fsdp=fsdp)
    GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=args, train_dataset=ROWS,
                processing_class=tokenizer, quiet=True).train()
    assert {budget for budget, _ in seen} == {3 * 2**20}
    assert {grad for _, grad in seen} == {True, False}  # passes that train and passes that do not


def test_a_budget_left_to_covey_holds_a_micro_batch_s_logits_where_the_memory_free_has_room(tmp_path, tokenizer,
                                                                                            monkeypatch):
    """logprob_budget_mib: None (the default): the passes get a micro-batch's whole logits where they take at most
    a quarter of the memory free once the model is loaded, else the default chunks (made small here, so the tiny
    model's logits are past them)."""
    import covey.core.logprobs as logprobs
    import covey.train.policy as policy
    from covey.plan import Device

    monkeypatch.setattr(logprobs, "LOGPROB_CHUNK_BYTES", 4096)
    args = small_args(tmp_path, max_steps=1, eval_max_samples=0)
    whole = args.per_device_train_batch_size * (args.max_completion_length + 1) * len(tokenizer) * 4
    for free, budget in ((4 * whole, whole), (4 * whole - 1, 4096)):
        monkeypatch.setattr(policy, "this_device", lambda *a, **k: Device("test", "cpu", free, free))
        trainer = GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[count_a], args=args, train_dataset=ROWS,
                              processing_class=tokenizer, quiet=True)
        assert trainer.parts.policy.logprob_budget_bytes == budget


def test_bfloat16_on_a_cpu_that_multiplies_it_in_software_is_said_before_training(tmp_path, tokenizer, monkeypatch):
    import warnings

    import covey.train.run_rules as run_rules

    folder = tmp_path / "model"  # by name: a model handed over loaded has no dtype to set
    make_model(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    def said(**settings):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            GRPOTrainer(model=str(folder), reward_funcs=[count_a], train_dataset=ROWS, quiet=True,
                        args=small_args(tmp_path, use_cpu=True, overwrite_output_dir=True, **settings))
        return [str(w.message) for w in caught if "no bfloat16 matrix products" in str(w.message)]

    monkeypatch.setattr(run_rules, "bfloat16_products_in_software", lambda device: device.type == "cpu")
    computed, = said(bf16=True)
    assert "covey computes bfloat16's in float32" in computed
    assert said(bf16=False) == []
    assert said(bf16=False, rollout_bf16=True) == [computed]
    loaded, = said(bf16=False, dtype="bfloat16")
    assert "multiplies in software" in loaded and "dtype: float32" in loaded
    monkeypatch.setattr(run_rules, "bfloat16_products_in_software", lambda device: False)
    assert said(bf16=True) == [] and said(dtype="bfloat16") == []


def test_the_saved_tokenizer_pads_as_the_one_given(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    given = make_tokenizer()
    given.pad_token = given.eos_token  # as many chat models ship: the trainer pads with another token
    given.resource = threading.Lock()  # a tokenizer that cannot be copied (remote code may hold such things)
    GRPOTrainer(model=tiny_model, reward_funcs=[count_a], train_dataset=ROWS, processing_class=given, quiet=True,
                args=small_args(tmp_path, max_steps=1, eval_max_samples=0, save_steps=1)).train()
    assert given.pad_token != given.eos_token and given.padding_side == "left"  # the trainer's own choices
    saved = AutoTokenizer.from_pretrained(tmp_path / "run" / "final_model")
    assert (saved.pad_token, saved.padding_side) == ("</s>", "right")


def test_lora_trains_only_the_adapter_and_saves_it(tmp_path, tokenizer, tiny_model_dir):
    args = small_args(tmp_path, model=str(tiny_model_dir), use_peft=True, lora_r=4, beta=0.1, max_steps=2)
    trainer = GRPOTrainer(reward_funcs=[count_a], args=args, train_dataset=ROWS, quiet=True)
    before = _snapshot(trainer.model)
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed)
    assert trainer.reference.frozen is None  # the reference is the base with the adapter disabled

    from peft import AutoPeftModelForCausalLM

    adapter = tmp_path / "run" / "final_model"
    assert (adapter / "adapter_config.json").is_file()
    loaded = AutoPeftModelForCausalLM.from_pretrained(adapter)
    weights = dict(loaded.named_parameters())
    assert any(torch.equal(weights[n], p) for n, p in trainer.model.named_parameters() if "lora_B" in n)

    # training goes on from the saved adapter: it is the policy, its adapter trainable
    args = small_args(tmp_path / "more", model=str(adapter), beta=0.1, max_steps=1)
    more = GRPOTrainer(reward_funcs=[count_a], args=args, train_dataset=ROWS, quiet=True)
    start = _snapshot(more.model)
    assert all(torch.equal(start[n], p) for n, p in trainer.model.named_parameters() if "lora_" in n)
    more.train()
    moved = {n for n, p in more.model.named_parameters() if not torch.equal(start[n], p)}
    assert moved and all("lora_" in n for n in moved)
    card = (tmp_path / "more" / "run" / "final_model" / "README.md").read_text()  # the adapter's settings, its base
    assert "| use_peft | True |" in card and "| lora_r | 4 |" in card and f"base model: `{tiny_model_dir}`" in card


def test_gradient_accumulation_matches_one_big_batch(tmp_path, tokenizer):
    """Same samples, same step: 2 micro-batches of 4 give the gradient of 1 batch of 8 (dapo)."""
    grads = []
    for micro, accum in ((8, 1), (4, 2)):
        model = make_model(len(tokenizer), seed=1)
        args = small_args(tmp_path / f"{micro}", per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                          max_steps=1, eval_max_samples=0)
        trainer = GRPOTrainer(model=model, reward_funcs=[count_a], args=args, train_dataset=ROWS,
                              processing_class=tokenizer, quiet=True)
        batch, fixed = scored_batch(trainer, [0, 1])
        trainer.optimizer.step = lambda: None  # keep the gradient for inspection
        trainer.optimizer.zero_grad = lambda set_to_none=True: None
        optimize(trainer, batch, fixed)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_a_run_folder_is_never_overwritten(tmp_path, tokenizer, tiny_model):
    run = tmp_path / "run"
    run.mkdir()
    (run / "precious.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="already holds files"):
        GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=small_args(tmp_path), train_dataset=ROWS,
                    processing_class=tokenizer)
    assert (run / "precious.txt").read_text() == "keep me"


def test_bad_inputs_fail_before_the_model_is_loaded(tmp_path, monkeypatch):
    import covey.train.assemble
    import covey.train.setup

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(covey.train.setup, "load_policy", no_loading)
    monkeypatch.setattr(covey.train.assemble, "load_processing", no_loading)
    with pytest.raises(DataError, match="no 'prompt' column"):
        GRPOTrainer(reward_funcs=[count_a], args=small_args(tmp_path), train_dataset=[{"text": "x"}])

    def two_values(completions, **kw):
        return [1.0, 0.0]

    with pytest.raises(RewardError, match="'two_values' returned 2 values for 1 completions"):
        GRPOTrainer(reward_funcs=[two_values], args=small_args(tmp_path), train_dataset=ROWS[:1])
    with pytest.raises(ConfigError, match="reward_weights has 2 values for 1 reward functions"):
        GRPOTrainer(reward_funcs=[count_a], args=small_args(tmp_path, reward_weights=[1, 2]), train_dataset=ROWS)
    with pytest.raises(RewardError, match="not a built-in"):
        GRPOTrainer(reward_funcs=["nonexistent_reward"], args=small_args(tmp_path), train_dataset=ROWS)
    def by_difficulty(completions, difficulty, **kw):
        return [float(d) for d in difficulty]

    with pytest.raises(DataError, match="an in-memory dataset: reward function 'by_difficulty' needs a column"):
        GRPOTrainer(reward_funcs=[by_difficulty], args=small_args(tmp_path), train_dataset=ROWS)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match="needs vLLM, which is not installed"):
            GRPOTrainer(reward_funcs=[count_a], args=small_args(tmp_path, use_vllm=True), train_dataset=ROWS)


def test_a_model_that_cannot_be_found_is_a_clear_error(tmp_path, tiny_model_dir):
    missing = tmp_path / "typo-model"
    for name, why in ((str(missing), f"there is no folder {missing}. Pass"), ("nobody/no-such-model", "")):
        with pytest.raises(ModelError, match=f"could not load model '{re.escape(name)}': {re.escape(why)}"):
            GRPOTrainer(model=name, reward_funcs=[count_a], args=small_args(tmp_path / "run"), train_dataset=ROWS)
    (tiny_model_dir / "config.json").unlink()  # a folder with a tokenizer but no model
    with pytest.raises(ModelError, match="could not load model"):
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[count_a], args=small_args(tmp_path / "run"),
                    train_dataset=ROWS)


def test_prompt_longer_than_the_limit_is_reported(tmp_path, tokenizer, tiny_model):
    with pytest.raises(DataError, match="row 0: prompt is .* tokens, over max_prompt_length=5"):
        GRPOTrainer(model=tiny_model, reward_funcs=[count_a], train_dataset=ROWS, processing_class=tokenizer,
                    args=small_args(tmp_path, max_prompt_length=5, prompt_overflow="error"))
    # by default, as the TRL releases before 1.16 did, the prompt keeps its last tokens, with a warning
    with pytest.warns(UserWarning, match=r"8 training prompts were longer than max_prompt_length=5 and were cut to "
                                         r"their last tokens: up to \d+ tokens over \(row \d, \d+ tokens; first: row 0\)"):
        trainer = GRPOTrainer(model=tiny_model, reward_funcs=[count_a], train_dataset=ROWS, processing_class=tokenizer,
                              args=small_args(tmp_path, max_prompt_length=5), quiet=True)
    assert all(len(ids) == 5 for ids in trainer.parts.prompts.ids)


def test_plain_text_prompts_get_string_completions(tmp_path, tokenizer, tiny_model):
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    rows = [{"prompt": "abc"}, {"prompt": "xyz"}]
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[spy], args=small_args(tmp_path, max_steps=1),
                          train_dataset=rows, processing_class=tokenizer, quiet=True)
    trainer.train()
    assert seen and all(isinstance(c, str) for c in seen)
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["max_steps"] == 1


@pytest.mark.parametrize("schedule, warmup, expected", [
    ("constant", 0.0, [1.0, 1.0, 1.0, 1.0]),
    ("linear", 0.0, [1.0, 0.75, 0.5, 0.25]),
    ("cosine", 0.5, [1 / 3, 2 / 3, 1.0, 0.5]),
    ("cosine_with_min_lr", 0.0, [1.0, 0.1 + 0.9 * 0.5 * (1 + 2 ** -0.5), 0.55, 0.1 + 0.9 * 0.5 * (1 - 2 ** -0.5)]),
])
def test_learning_rate_schedules(tmp_path, tokenizer, tiny_model, schedule, warmup, expected):
    kwargs = {"min_lr_rate": 0.1} if schedule == "cosine_with_min_lr" else None  # transformers' name
    args = small_args(tmp_path, max_steps=4, lr_scheduler_type=schedule, warmup_ratio=warmup, learning_rate=1.0,
                      lr_scheduler_kwargs=kwargs)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=args, train_dataset=ROWS,
                          processing_class=tokenizer)
    assert [lr_schedule(trainer.args)(s) for s in range(4)] == pytest.approx(expected)


@pytest.mark.parametrize("warmup_steps", [2, 0.5])  # TRL's name: steps, or a fraction of max_steps below 1
def test_warmup_steps_set_the_warmup_as_in_trl(tmp_path, tokenizer, tiny_model, warmup_steps):
    args = small_args(tmp_path, max_steps=4, lr_scheduler_type="cosine", warmup_steps=warmup_steps, learning_rate=1.0)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=args, train_dataset=ROWS,
                          processing_class=tokenizer)
    assert [lr_schedule(trainer.args)(s) for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 0.5])


def test_cosine_with_min_lr_takes_the_floor_as_transformers_does():
    rate = GRPOConfig(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 1e-6}, learning_rate=1e-5,
                      max_steps=4)
    assert lr_schedule(rate)(4) == pytest.approx(0.1)  # min_lr / learning_rate at the end
    assert GRPOConfig.from_dict({"lr_scheduler_type": "cosine_with_min_lr",
                                 "lr_scheduler_kwargs": '{"min_lr_rate": 0.2}'}).lr_scheduler_kwargs == {"min_lr_rate": 0.2}
    for fields, message in ((dict(lr_scheduler_type="cosine_with_min_lr"), "needs lr_scheduler_kwargs with one of"),
                            (dict(lr_scheduler_type="cosine", lr_scheduler_kwargs={"min_lr_rate": 0.1}),
                             "has no meaning for lr_scheduler_type: cosine"),
                            (dict(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": -1}),
                             "the floor must be a number >= 0")):
        with pytest.raises(ConfigError, match=message):
            GRPOConfig(**fields)


@pytest.mark.parametrize("fields, message", [
    (dict(warmup_steps=2.5), "warmup_steps=2.5 must be a whole number of steps, or a fraction"),
    (dict(warmup_steps=-1), "warmup_steps=-1 must be a whole number"),
    (dict(warmup_steps=2, warmup_ratio=0.1), "both set the warmup; keep one"),
])
def test_a_warmup_that_cannot_be_meant_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**fields)


def test_max_steps_minus_one_trains_for_num_train_epochs_as_in_trl(tmp_path, tokenizer, tiny_model):
    # 8 prompts, 2 a round (4 x 2 completions, groups of 4): 1.5 passes are 6 rounds of one step each
    args = small_args(tmp_path, max_steps=-1, num_train_epochs=1.5, eval_max_samples=0)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=args, train_dataset=ROWS,
                          processing_class=tokenizer)
    assert trainer.args.max_steps == 6 and args.max_steps == -1  # the caller's config is left as it was
    trainer.train()
    summary = trainer.summary
    assert summary["steps"] == 6 and trainer.prompt_sampler.progress == pytest.approx(1.5)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["max_steps"] == -1 and saved["num_train_epochs"] == 1.5  # as given: a resume resolves it again


def test_epochs_count_the_prompts_kept(tmp_path, tokenizer, tiny_model):
    long = {"prompt": [{"role": "user", "content": "x" * 200}], "answer": "9"}
    args = small_args(tmp_path, max_steps=-1, num_train_epochs=1.5, max_prompt_length=40, prompt_overflow="drop")
    with pytest.warns(UserWarning, match="1 training prompts were longer"):
        trainer = GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=args, train_dataset=ROWS + [long],
                              processing_class=tokenizer)
    assert trainer.args.max_steps == 6  # 1.5 passes over the 8 prompts kept, 2 a round (7 over all 9)


@pytest.mark.parametrize("fields, prompts, processes, steps", [
    (dict(num_train_epochs=1), 10, 1, 5),  # 2 prompts a round
    (dict(num_train_epochs=1.5), 10, 1, 8),  # whole rounds: 7.5 -> 8
    (dict(num_train_epochs=1, num_iterations=2), 10, 1, 10),  # each round's batch trained twice
    (dict(num_train_epochs=1), 10, 2, 3),  # 4 prompts a round over two processes
    (dict(), 10, 1, 15),  # 3 passes when unset, as in TRL
])
def test_steps_for_epochs(fields, prompts, processes, steps):
    args = GRPOConfig(max_steps=-1, num_generations=4, per_device_train_batch_size=8, **fields)
    assert args.steps_for_epochs(prompts, processes) == steps


def test_num_train_epochs_moves_across_from_a_trl_config(tmp_path):
    assert GRPOConfig.from_dict({"num_train_epochs": 2}).max_steps == -1  # TRL's default max_steps
    with pytest.warns(UserWarning, match="num_train_epochs=2 has no effect: max_steps=5 sets the run's length"):
        args = GRPOConfig.from_dict({"num_train_epochs": 2, "max_steps": 5})
    assert args.max_steps == 5 and args.num_train_epochs is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = GRPOConfig.from_dict({"num_train_epochs": "2", "max_steps": "-1"})  # as text from the command line
    assert args.max_steps == -1 and args.num_train_epochs == 2
    assert GRPOConfig(num_train_epochs=2).max_steps == -1  # Python's door follows the same rule
    with pytest.warns(UserWarning, match="num_train_epochs=2 has no effect: max_steps=5"):
        assert GRPOConfig(num_train_epochs=2, max_steps=5).num_train_epochs is None
    with pytest.raises(ConfigError, match="max_steps=0 must be at least 1, or -1"):
        GRPOConfig(max_steps=0)
    with pytest.raises(ConfigError, match="num_train_epochs=0 must be positive"):
        GRPOConfig(max_steps=-1, num_train_epochs=0)


@pytest.mark.parametrize("policy", ["drop", "truncate_left"])
def test_prompt_overflow_policies(tmp_path, tokenizer, tiny_model, policy):
    rows = ROWS[:3] + [{"prompt": [{"role": "user", "content": "x" * 200}], "answer": "9"}]
    args = small_args(tmp_path, max_prompt_length=40, prompt_overflow=policy)
    with pytest.warns(UserWarning, match="1 training prompts were longer than max_prompt_length=40"):
        trainer = GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=args, train_dataset=rows,
                              processing_class=tokenizer)
    assert trainer.run.prompt_overflow_count == 1
    prompts = trainer.parts.prompts
    assert len(prompts.rows) == (3 if policy == "drop" else 4)
    assert max(len(ids) for ids in prompts.ids) <= 40
    if policy == "truncate_left":  # the end of the prompt, where the assistant turn opens, is kept
        assert tokenizer.decode(prompts.ids[3]).endswith("assistant\n")


def test_completions_are_recorded_every_log_completions_steps_and_shown_as_a_table(tmp_path, tokenizer, capsys):
    args = small_args(tmp_path, max_steps=5, gradient_accumulation_steps=1, log_completions_steps=2,
                      num_completions_to_print=3, eval_max_samples=0)
    GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[count_a], args=args, train_dataset=ROWS,
                processing_class=tokenizer).train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in lines}) == [1, 2, 4, 5]  # the first, every 2nd, the last
    assert all(len([r for r in lines if r["step"] == s]) == 4 for s in (1, 2, 4, 5))
    shown = capsys.readouterr().err
    for step in (1, 2, 4, 5):
        assert f"step {step}: sample completions" in shown
    assert "step 3: sample completions" not in shown and "count_a" in shown and "advantage" in shown


def test_models_load_without_remote_code_and_save_as_safetensors_only(tmp_path, tokenizer, tiny_model_dir, monkeypatch):
    import transformers

    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[count_a], args=small_args(tmp_path, max_steps=1),
                train_dataset=ROWS).train()
    assert seen and seen == [False] * len(seen)  # off unless the config turns it on
    saved = {p.name for p in (tmp_path / "run" / "final_model").iterdir()}
    assert "model.safetensors" in saved and not {n for n in saved if n.endswith((".bin", ".pt", ".pkl"))}


def _model_with_dropout(tokenizer):
    model = make_model(len(tokenizer), seed=2)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5  # what attention modules read while training
    return model


@pytest.mark.parametrize("disable", [False, True])
def test_old_and_reference_logprobs_never_see_dropout_and_disable_dropout_turns_it_off(tmp_path, tokenizer, disable):
    args = small_args(tmp_path, use_peft=True, lora_r=4, lora_dropout=0.5, beta=0.1, disable_dropout=disable)
    trainer = GRPOTrainer(model=_model_with_dropout(tokenizer), reward_funcs=[count_a], args=args, train_dataset=ROWS,
                          processing_class=tokenizer, quiet=True)
    sequences = scored_batch(trainer, [0, 1])[0].samples.sequences
    trainer.model.train()  # as after an optimizer step
    old = [logprobs_no_grad(trainer.parts, trainer.model, sequences) for _ in range(2)]
    assert torch.equal(old[0], old[1]) and trainer.model.training
    from covey.train.forward import completion_logprobs

    micro = sequences.rows(slice(0, 4))
    with torch.no_grad():
        train_mode = [completion_logprobs(trainer.model, micro, 1.0)[0] for _ in range(2)]
    assert torch.equal(train_mode[0], train_mode[1]) == disable
    rates = [m.p for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    rates += [m.attention_dropout for m in trainer.model.modules() if hasattr(m, "attention_dropout")]
    assert rates and all((rate == 0) == disable for rate in rates)


def test_held_out_evaluation_runs_under_the_training_settings(tmp_path, tokenizer, tiny_model):
    long_prompt = [{"role": "user", "content": "say " + "a" * 400}]
    held_out = [*ROWS[:3], {"prompt": long_prompt, "answer": "0"}]

    def fails_on_held_out_rows(completions, answer, **kwargs):
        if any(a == "held-out" for a in answer):
            raise ValueError("no score for this one")
        return [1.0] * len(completions)

    args = small_args(tmp_path, prompt_overflow="drop", reward_errors="skip", max_prompt_length=64)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[fails_on_held_out_rows], args=args, train_dataset=ROWS,
                          eval_dataset=[*held_out[:2], {**held_out[2], "answer": "held-out"}, held_out[3]],
                          processing_class=tokenizer, quiet=True)
    result = trainer.held_out_result()
    # the over-long prompt is dropped as in training; the failing row is scored None, not an error
    assert result["n"] == 3 and len(result["samples"]) == 3
    assert result["mean_reward"] == 1.0 and result["accuracy"] is not None

    no_answers = [{"prompt": r["prompt"]} for r in ROWS[:2]]
    result = trainer.held_out_result(no_answers)
    assert result["accuracy"] is None  # nothing to check against: not 0%
    from covey.telemetry.tables import before_after_rows

    assert before_after_rows(result, result)[0][1] == "n/a" and before_after_rows(result, result)[2][1] == "n/a"
    # rows whose answer holds no number are not counted as wrong; a mean reward of none at all is n/a
    always_two = [{"prompt": r["prompt"], "answer": a} for r, a in zip(ROWS, ["2", "unknown", None])]
    trainer.engine.generate = lambda prompt_ids, n, params, seed=None: _answering("<answer>2</answer>", tokenizer,
                                                                                  len(prompt_ids))
    assert trainer.held_out_result(always_two)["accuracy"] == 1.0
    nothing = {"accuracy": None, "mean_reward": None, "n": 3}  # as summary.json holds a NaN mean
    assert before_after_rows(nothing, nothing) == [["before", "n/a", "n/a", "3"], ["after", "n/a", "n/a", "3"],
                                                   ["change", "n/a", "n/a", ""]]


def _answering(text: str, tokenizer, rows: int):
    """A rollout in which every row completes with ``text`` and EOS."""
    from covey.rollout import Rollout

    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids_BT = torch.tensor([ids] * rows)
    return Rollout(ids_BT, torch.ones_like(ids_BT), torch.zeros(ids_BT.shape), ["eos"] * rows)


def test_the_trained_model_is_saved_before_the_last_evaluation_can_fail(tmp_path, tokenizer, tiny_model, monkeypatch):
    trained = tmp_path / "trained"  # a file: reward workers may run in processes of their own

    def breaks_after_training(completions, **kwargs):
        if trained.exists():
            raise RuntimeError("the scoring service went away")
        return [float(len(c[0]["content"]) % 3) for c in completions]

    args = small_args(tmp_path, max_steps=1)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[breaks_after_training], args=args, train_dataset=ROWS,
                          eval_dataset=ROWS[:2], processing_class=tokenizer, quiet=True)
    optimizer_step = step_module.optimizer_step

    def optimize_then_break(*a, **k):
        stats = optimizer_step(*a, **k)
        trained.touch()
        return stats

    monkeypatch.setattr(step_module, "optimizer_step", optimize_then_break)
    with pytest.raises(RewardError, match="breaks_after_training"):
        trainer.train()
    saved = tmp_path / "run" / "final_model"
    assert (saved / "model.safetensors").is_file() and (saved / "config.json").is_file()


def test_held_out_prompts_that_are_training_prompts_are_warned_about(tmp_path, tokenizer, tiny_model):
    with pytest.warns(UserWarning, match="2 of the 3 held-out prompts are training prompts too"):
        GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=small_args(tmp_path), train_dataset=ROWS[:6],
                    eval_dataset=[ROWS[0], ROWS[7], ROWS[3]], processing_class=tokenizer, quiet=True)


def test_the_saved_config_names_what_the_run_was_given(tmp_path, tokenizer, tiny_model):
    from peft import LoraConfig

    def local_reward(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[count_a, "answer_format", local_reward],
                          args=small_args(tmp_path, max_steps=1, reward_weights=[1.0, 1.0, 1.0]), train_dataset=ROWS,
                          eval_dataset=ROWS[:2], processing_class=tokenizer, quiet=True,
                          peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj", "q_proj"]))
    trainer.train()
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["model"] == "<in-memory LlamaForCausalLM>"  # not the default model, which the run did not use
    assert saved["dataset"] == saved["eval_dataset"] == "<in-memory dataset>"
    assert saved["reward_funcs"] == ["tests.test_trainer:count_a", "answer_format", "<in-memory function local_reward>"]
    assert (saved["use_peft"], saved["lora_r"], saved["lora_alpha"], saved["lora_target_modules"]) == (
        True, 2, 4, ["q_proj", "v_proj"])
    card = (tmp_path / "run" / "final_model" / "README.md").read_text()  # the model card says the same
    assert "| use_peft | True |" in card and "| lora_r | 2 |" in card and "| lora_alpha | 4 |" in card
    from covey.rewards import load_reward_func

    assert load_reward_func(saved["reward_funcs"][0]) is count_a
    assert GRPOConfig.from_yaml(tmp_path / "run" / "config.yaml").model == "<in-memory LlamaForCausalLM>"
    # the markers load nothing, and say so
    from covey.data import load_rows
    from covey.models import load_policy

    for load, value, error in ((load_rows, saved["dataset"], DataError), (load_policy, saved["model"], ModelError),
                               (load_reward_func, saved["reward_funcs"][2], RewardError)):
        with pytest.raises(error, match="is how a run's config.yaml notes what was passed in memory"):
            load(value)


def test_reward_functions_get_trls_trainer_state_log_metric_and_log_extra(tmp_path, tokenizer, tiny_model):
    seen = []

    def with_trl_extras(completions, trainer_state, log_metric, log_extra, **kwargs):
        seen.append((trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch))
        lengths = [len(c[0]["content"]) for c in completions]
        log_metric("custom/mean_chars", sum(lengths) / len(lengths))
        log_extra("chars", np.array(lengths))  # numpy values are written as plain numbers
        log_extra("reward", ["never over covey's own"] * len(completions))
        return [n % 3 / 2 for n in lengths]

    args = small_args(tmp_path, max_steps=2, eval_max_samples=0, log_completions_steps=1,
                      reward_probes=False)  # the probes' calls: tests/test_reward_probes_in_runs.py
    GRPOTrainer(model=tiny_model, reward_funcs=[with_trl_extras], args=args, train_dataset=ROWS,
                processing_class=tokenizer, quiet=True).train()
    # the optimizer steps taken, of max_steps, and the passes over the data done (8 rows, 2 prompts a round),
    # after the placeholder call that checks the function before any model loads
    assert seen == [(0, 2, 0.0), (0, 2, 0.25), (1, 2, 0.5)]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["custom/mean_chars"] > 0 for m in metrics)
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert all(r["chars"] == len(r["completion"]) for r in records)
    assert all(isinstance(r["reward"], float) for r in records)


_REALLOCATE = """
import resource, sys, torch
from covey.models import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for _ in range(2):  # 256 MB, far over the C library's mmap threshold; kept from the second time on
    torch.ones(64 << 20).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    torch.ones(64 << 20).sum()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_keep_freed_memory_spares_the_page_faults_of_allocating_large_tensors_again():
    faults = {how: int(subprocess.run([sys.executable, "-c", _REALLOCATE, how], capture_output=True, text=True,
                                      check=True).stdout) for how in ("keep", "default")}
    assert faults["default"] > 4 * 60_000  # each 256 MB tensor faulted in again, page by page
    assert faults["keep"] < faults["default"] / 20


@pytest.mark.parametrize("keep", [True, False])
def test_training_keeps_freed_memory_as_configured(tmp_path, tokenizer, tiny_model, monkeypatch, keep):
    import covey.train.setup
    import covey.train.trainer

    calls = []
    monkeypatch.setattr(covey.train.trainer, "keep_freed_memory", lambda: calls.append(1) or True)
    args = small_args(tmp_path, max_steps=1, eval_max_samples=0, keep_freed_memory=keep)
    GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=args, train_dataset=ROWS, processing_class=tokenizer,
                quiet=True).train()
    assert calls == ([1] if keep else [])


def test_reward_functions_sharing_a_name_are_refused_before_the_model_loads(tmp_path):
    import functools

    def graded(completions, scale, **_):
        return [scale * len(c) for c in completions]

    with pytest.raises(ConfigError, match="both named 'graded'"):
        GRPOTrainer(model="no/such-model-is-loaded", args=small_args(tmp_path), train_dataset=ROWS,
                    reward_funcs=[functools.partial(graded, scale=1.0), functools.partial(graded, scale=2.0)])


def test_throughput_and_undefined_spreads_are_logged_on_every_step(tmp_path, tokenizer, tiny_model):
    def undefined(completions, **_):
        return [None] * len(completions)

    args = small_args(tmp_path, max_steps=4, num_iterations=2, gradient_accumulation_steps=1, eval_max_samples=0)
    GRPOTrainer(model=tiny_model, reward_funcs=[count_a, undefined], args=args, train_dataset=ROWS,
                processing_class=tokenizer, quiet=True).train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [m["tokens_per_second"] for m in metrics]
    # each round: sampled once, trained twice; the rate is the batch's tokens per second of the round so far
    assert all(rate > 0 for rate in rates) and rates[1] < rates[0] and rates[3] < rates[2]
    assert all(m["rewards/undefined/std"] is None and m["rewards/undefined/mean"] is None for m in metrics)
    assert all(m["rewards/count_a/std"] is not None for m in metrics)


def test_evaluation_during_training_is_logged_at_its_steps(tmp_path, tokenizer, tiny_model):
    """eval_strategy: steps (TRL's): the held-out evaluation every eval_steps, as eval/... metrics on that
    step's line (written whatever logging_steps says), and drawn by covey report."""
    from covey.telemetry.report import load_run, panels

    args = small_args(tmp_path, max_steps=5, logging_steps=3, eval_strategy="steps", eval_steps=2)
    evaluations = []
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=args, train_dataset=ROWS,
                          eval_dataset=ROWS[:2], processing_class=tokenizer, quiet=True)
    evaluate = trainer.held_out_result
    trainer.held_out_result = lambda *a: evaluations.append(trainer.global_step) or evaluate(*a)
    trainer.train()
    assert evaluations == [0, 2, 4, 5]  # before training, at steps 2 and 4, after training
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 3, 4, 5]
    assert [m["step"] for m in metrics if "eval/accuracy" in m] == [2, 4]
    assert all(0 <= m["eval/mean_reward"] for m in metrics if "eval/mean_reward" in m)
    # both held-out rows have a numeric answer: two problems checked at each evaluation, and before training
    assert [m["eval/checked"] for m in metrics if "eval/accuracy" in m] == [2, 2]
    assert trainer.run_state.before["checked"] == 2
    run = load_run(tmp_path / "run")
    assert {"eval/accuracy", "eval/mean_reward"} <= {p.key for p in panels(run)}
    with pytest.raises(ConfigError, match="eval_strategy: steps evaluates on held-out data, and an in-memory dataset "
                                          "brings none"):
        GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=small_args(tmp_path / "b", eval_strategy="steps"),
                    train_dataset=ROWS, processing_class=tokenizer, quiet=True)


@pytest.mark.parametrize("k", [None, 3])
def test_evaluation_batches_and_generations_per_row_follow_trl_s_eval_settings(tmp_path, tokenizer, tiny_model, k):
    args = small_args(tmp_path, eval_max_samples=5, per_device_eval_batch_size=6, num_generations_eval=k)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=args, train_dataset=ROWS,
                          eval_dataset=ROWS[:5], processing_class=tokenizer, quiet=True)
    calls, real = [], trainer.engine.generate
    trainer.engine.generate = lambda ids, n, params, seed=None: calls.append((len(ids), n, params.greedy)) or real(
        ids, n, params, seed)
    result = trainer.held_out_result()
    per_row = k or 1
    assert [c[0] * c[1] for c in calls] == ([6, 6, 3] if k else [5])  # at most 6 completions per call
    assert all(c[1] == per_row and c[2] == (k is None) for c in calls)  # k sampled, or one greedy
    assert sum(c[0] for c in calls) == 5 and len(result["samples"]) == 5 * per_row and result["n"] == 5
    # the accuracy's binomial error is over problems: k completions of one problem are not k trials
    assert result["checked"] == 5  # every row's answer is a number


def test_log_level_sets_what_transformers_prints(tmp_path, tokenizer, tiny_model):
    from transformers.utils import logging

    from covey.models import set_log_level

    try:
        GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=small_args(tmp_path, log_level="info"),
                    train_dataset=ROWS, processing_class=tokenizer, quiet=True)
        assert logging.get_verbosity() == logging.INFO
    finally:
        set_log_level("passive")
    assert logging.get_verbosity() == logging.ERROR
