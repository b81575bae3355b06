"""Asynchronous generation: the next rounds sampled by a worker while the trainer trains, each row
corrected for the policy that sampled it, staleness bounded, a fixed schedule reproducible."""

import dataclasses
import json

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.errors import ConfigError
from covey.train.asynchronous import AsyncSchedule
from tests.conftest import make_model, make_tokenizer
from tests.test_trainer import ROWS, count_a


def async_args(tmp_path, name="run", **overrides):
    values = dict(output_dir=str(tmp_path / name), max_steps=4, num_generations=4, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, max_completion_length=8, learning_rate=1e-2, seed=3,
                  async_generation=True, eval_strategy="no")
    values.update(overrides)
    return GRPOConfig(**values)


def train(args):
    tokenizer = make_tokenizer()
    trainer = GRPOTrainer(model=make_model(len(tokenizer), seed=1), reward_funcs=[count_a], args=args,
                          train_dataset=ROWS, processing_class=tokenizer, quiet=True)
    trainer.train()
    lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    return trainer, [json.loads(line) for line in lines]


def test_async_rounds_are_sampled_one_round_behind_and_the_staleness_is_logged(tmp_path):
    trainer, metrics = train(async_args(tmp_path))
    steps = [m for m in metrics if "async/staleness" in m]
    assert [m["async/staleness"] for m in steps] == [0.0, 1.0, 1.0, 1.0]  # round 0 and 1 both from the start
    assert all(m["async/dropped_rows"] == 0 for m in steps)
    assert all(m["time/wait_for_data"] >= 0 and m["time/wait_for_weights"] >= 0 for m in steps)
    assert trainer.global_step == 4


def test_a_fixed_schedule_makes_a_seeded_async_run_reproducible(tmp_path):
    _, first = train(async_args(tmp_path, "a"))
    _, second = train(async_args(tmp_path, "b"))
    keys = ("loss", "reward", "grad_norm")
    assert [[m.get(k) for k in keys] for m in first] == [[m.get(k) for k in keys] for m in second]


def test_async_settings_that_cannot_be_honoured_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="max_staleness=1 is below the 2 optimizer step"):
        async_args(tmp_path, steps_per_generation=4)
    with pytest.raises(ConfigError, match="vllm_importance_sampling_correction: false"):
        async_args(tmp_path, vllm_importance_sampling_correction=False)
    with pytest.raises(ConfigError, match="rollout_engine vllm is not supported yet"):
        async_args(tmp_path, use_vllm=True)
    with pytest.raises(ConfigError, match="save_strategy: epoch"):
        async_args(tmp_path, save_strategy="epoch")


def test_the_schedule_runs_whole_rounds_ahead():
    args = GRPOConfig(async_generation=True, max_staleness=5, steps_per_generation=2, per_device_train_batch_size=4,
                      num_generations=4, gradient_accumulation_steps=1)
    schedule = AsyncSchedule.from_args(args)
    assert args.optimizer_steps_per_generation == 2 and schedule.rounds_ahead == 2
    assert [schedule.snapshot_for(r) for r in range(5)] == [0, 0, 0, 1, 2]


def verify_async(tokenizer=None):
    from covey.verify import verify
    from tests.test_verify import ROWS as VERIFY_ROWS, mentions_answer, variety

    tokenizer = tokenizer or make_tokenizer()
    args = GRPOConfig(num_generations=4, max_completion_length=10, temperature=0.7, seed=3, async_generation=True)
    return verify(args, num_prompts=2, model=make_model(len(tokenizer), seed=5), processing_class=tokenizer,
                  train_dataset=VERIFY_ROWS, reward_funcs=[variety, mentions_answer])


def test_verify_checks_the_correction_against_a_deliberately_older_policy():
    report = verify_async()
    checks = [c for c in report.checks if c.stage == "async"]
    assert [c.status for c in checks] == ["PASS", "PASS"], [(c.name, c.value) for c in report.checks]
    assert "current policy is" in checks[0].value and " 0 away" not in checks[0].value


@pytest.mark.parametrize("defect", ["no correction", "the current policy's log-probs"])
def test_verify_catches_a_correction_that_ignores_the_policy_that_sampled(monkeypatch, defect):
    import covey.train.step as step_module

    if defect == "no correction":  # the rows treated as sampled by the policy that trains
        monkeypatch.setattr(step_module, "sampled_exactly", lambda parts: True)
    else:  # the rows' sampling log-probs replaced by the trainer's at the time it trains
        original = step_module.fixed_logprobs

        def current_as_sampling(parts, batch):
            current = step_module.logprobs_no_grad(parts, parts.model, batch.samples.sequences)
            samples = dataclasses.replace(batch.samples, sampling_logp_BT=current)
            object.__setattr__(batch, "samples", samples)
            return original(parts, batch)
        monkeypatch.setattr(step_module, "fixed_logprobs", current_as_sampling)
    report = verify_async()
    assert report.first_failure == "async", [(c.stage, c.name, c.value) for c in report.checks if c.status == "FAIL"]


def test_an_error_in_the_worker_stops_the_run_with_that_error(tmp_path):
    from covey.errors import RewardError

    def failing(completions, **kwargs):
        raise ValueError("the judge is down")

    tokenizer = make_tokenizer()
    trainer = GRPOTrainer(model=make_model(len(tokenizer), seed=1), reward_funcs=[count_a, failing],
                          args=async_args(tmp_path), train_dataset=ROWS, processing_class=tokenizer, quiet=True)
    with pytest.raises(RewardError, match="the judge is down"):
        trainer.train()
    assert trainer.global_step == 0


def test_rounds_staler_than_the_bound_are_dropped_and_counted(tmp_path, monkeypatch):
    # a worker stuck on the starting weights: from round 2 on, every round is 2 steps stale
    monkeypatch.setattr(AsyncSchedule, "snapshot_for", lambda self, round_index: 0)
    tokenizer = make_tokenizer()
    trainer = GRPOTrainer(model=make_model(len(tokenizer), seed=1), reward_funcs=[count_a],
                          args=async_args(tmp_path, max_steps=3), train_dataset=ROWS, processing_class=tokenizer,
                          quiet=True)
    with pytest.raises(RuntimeError, match="5 rounds in a row were staler than max_staleness=1"):
        trainer.train()
    assert trainer.global_step == 2


def test_the_latest_schedule_samples_with_the_newest_weights_within_the_bound(tmp_path):
    _, metrics = train(async_args(tmp_path, async_schedule="latest", max_staleness=2, max_steps=5))
    staleness = [m["async/staleness"] for m in metrics if "async/staleness" in m]
    assert len(staleness) == 5 and all(0 <= s <= 2 for s in staleness) and staleness[0] == 0
