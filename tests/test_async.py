"""Asynchronous generation: the next rounds sampled by a worker while the trainer trains, each row
corrected for the policy that sampled it, staleness bounded, a fixed schedule reproducible."""

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


def test_the_schedule_runs_whole_rounds_ahead():
    args = GRPOConfig(async_generation=True, max_staleness=5, steps_per_generation=2, per_device_train_batch_size=4,
                      num_generations=4, gradient_accumulation_steps=1)
    schedule = AsyncSchedule.from_args(args)
    assert args.optimizer_steps_per_generation == 2 and schedule.rounds_ahead == 2
    assert [schedule.snapshot_for(r) for r in range(5)] == [0, 0, 0, 1, 2]
