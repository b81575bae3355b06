"""Asynchronous generation: the next rounds sampled by a worker while the trainer trains, each row
corrected for the policy that sampled it, staleness bounded, a fixed schedule reproducible."""

import dataclasses
import json

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.errors import ConfigError
from covey.train.asynchronous import AsyncSchedule
from tests.conftest import SMALL_RUN, make_model, make_tokenizer
from tests.test_trainer import ROWS, count_a


def async_args(tmp_path, name="run", **overrides):
    values = dict(output_dir=str(tmp_path / name), max_steps=4, num_generations=4, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, max_completion_length=8, learning_rate=1e-2, seed=3,
                  async_generation=True, eval_strategy="no")
    values = {**SMALL_RUN, **values}  # what the run relies on beyond its sizes
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
    # the first round is sampled while the trainer waits for it; every step reports both waits
    assert steps[0]["time/wait_for_data"] > 0
    assert all(isinstance(m["time/wait_for_data"], float) and isinstance(m["time/wait_for_weights"], float)
               for m in steps)
    assert trainer.global_step == 4


def test_a_fixed_schedule_makes_a_seeded_async_run_reproducible(tmp_path):
    _, first = train(async_args(tmp_path, "a"))
    _, second = train(async_args(tmp_path, "b"))
    keys = ("loss", "reward", "grad_norm")
    assert [[m.get(k) for k in keys] for m in first] == [[m.get(k) for k in keys] for m in second]


def test_the_epoch_logs_and_callbacks_see_is_that_of_the_rounds_trained(tmp_path):
    from transformers import TrainerCallback

    def epochs(async_generation):
        seen = []

        class Epochs(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                seen.append((logs["epoch"], state.epoch))

        tokenizer = make_tokenizer()
        args = async_args(tmp_path, f"run-{async_generation}", async_generation=async_generation, logging_steps=1)
        GRPOTrainer(model=make_model(len(tokenizer), seed=1), reward_funcs=[count_a], args=args, train_dataset=ROWS,
                    processing_class=tokenizer, callbacks=[Epochs()], quiet=True).train()
        return seen
    synchronous = epochs(False)
    # 2 of the 8 prompts a round; then the closing entry of train()
    assert synchronous == [(0.25, 0.25), (0.5, 0.5), (0.75, 0.75), (1.0, 1.0), (1.0, 1.0)]
    assert epochs(True) == synchronous  # though the worker has drawn a round further


def test_async_settings_that_cannot_be_honoured_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="max_staleness=1 is below the 2 optimizer step"):
        async_args(tmp_path, steps_per_generation=4)
    with pytest.raises(ConfigError, match="vllm_importance_sampling_correction: false"):
        async_args(tmp_path, vllm_importance_sampling_correction=False)
    with pytest.raises(ConfigError, match="vllm_enable_sleep_mode puts vLLM to sleep"):
        async_args(tmp_path, use_vllm=True, vllm_enable_sleep_mode=True)


def test_what_the_worker_cannot_sample_for_is_refused_before_the_model_loads(tmp_path):
    from covey.rollout import SamplesWithPolicy

    class OwnLoop(SamplesWithPolicy):  # samples with the module it is given: the worker cannot rebuild it
        exact_logprobs = True

        def generate(self, *args, **kwargs):
            raise AssertionError("never reached")

    never = str(tmp_path / "never-loaded")
    with pytest.raises(ConfigError, match="async_generation: rollout_engine OwnLoop: the worker builds its own"):
        GRPOTrainer(model=never, reward_funcs=[count_a], args=async_args(tmp_path), train_dataset=ROWS,
                    rollout_engine=OwnLoop())
    with pytest.raises(ConfigError, match="async_generation: rollout_func samples the completions itself"):
        GRPOTrainer(model=never, reward_funcs=[count_a], args=async_args(tmp_path), train_dataset=ROWS,
                    rollout_func=lambda prompts, trainer: {})
    assert not (tmp_path / "run").exists()


def test_several_processes_train_asynchronously_unless_their_workers_would_share_a_server_or_a_refill():
    from covey.train.asynchronous import check_async_run

    plain, refill = GRPOConfig(async_generation=True), GRPOConfig(async_generation=True, dynamic_sampling=True)
    check_async_run(plain, 2, None, own_rollouts=False, server=False)  # DDP, an engine each
    with pytest.raises(ConfigError, match="2 processes sampling from one server"):
        check_async_run(plain, 2, None, own_rollouts=False, server=True)
    with pytest.raises(ConfigError, match="dynamic_sampling with 2 processes"):
        check_async_run(refill, 2, None, own_rollouts=False, server=False)
    check_async_run(refill, 1, None, own_rollouts=False, server=True)  # one process: both fine


def test_the_schedule_runs_whole_rounds_ahead():
    args = GRPOConfig(async_generation=True, max_staleness=5, steps_per_generation=2, per_device_train_batch_size=4,
                      num_generations=4, gradient_accumulation_steps=1)
    schedule = AsyncSchedule.from_args(args)
    assert args.optimizer_steps_per_generation == 2 and schedule.rounds_ahead == 2
    assert [schedule.snapshot_for(r) for r in range(5)] == [0, 0, 0, 1, 2]


def verify_async(tokenizer=None, **fields):
    from covey.verify import verify
    from tests.test_verify import ROWS as VERIFY_ROWS, mentions_answer, variety

    tokenizer = tokenizer or make_tokenizer()
    args = GRPOConfig(num_generations=4, max_completion_length=10, temperature=0.7, seed=3, async_generation=True,
                      **fields)
    return verify(args, num_prompts=2, model=make_model(len(tokenizer), seed=5), processing_class=tokenizer,
                  train_dataset=VERIFY_ROWS, reward_funcs=[variety, mentions_answer])


def test_verify_checks_the_correction_against_a_deliberately_older_policy():
    report = verify_async()
    checks = [c for c in report.checks if c.stage == "async"]
    assert [c.status for c in checks] == ["PASS", "PASS"], [(c.name, c.value) for c in report.checks]
    assert "current policy is" in checks[0].value and " 0 away" not in checks[0].value


def test_verify_checks_the_correction_through_a_server_the_older_policy_pushed_to_it():
    from tests.test_server import serve

    tokenizer = make_tokenizer()
    server = serve(make_model(len(tokenizer), seed=6), tokenizer)
    try:
        report = verify_async(tokenizer, rollout_engine="vllm", vllm_mode="server",
                              vllm_server_port=server.server_address[1], vllm_server_timeout=5.0)
    finally:
        server.close()
    checks = [c for c in report.checks if c.stage == "async"]
    assert [c.status for c in checks] == ["PASS", "PASS"], [(c.name, c.value) for c in report.checks]


@pytest.mark.parametrize("defect", ["no correction", "the current policy's log-probs"])
def test_verify_catches_a_correction_that_ignores_the_policy_that_sampled(monkeypatch, defect):
    from covey.train import update
    from covey.train.sampler import Sampler

    if defect == "no correction":  # the rows treated as sampled by the policy that trains
        monkeypatch.setattr(Sampler, "exact", property(lambda self: True))
    else:  # the rows' sampling log-probs replaced by the trainer's at the time it trains
        original = update.fixed_logprobs

        def current_as_sampling(parts, batch):
            current = update.logprobs_no_grad(parts, parts.policy.model, batch.samples.sequences)
            samples = dataclasses.replace(batch.samples, sampling_logp_BT=current)
            object.__setattr__(batch, "samples", samples)
            return original(parts, batch)
        monkeypatch.setattr(update, "fixed_logprobs", current_as_sampling)
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


def test_through_a_server_each_round_is_sampled_with_its_snapshot_and_evaluations_with_the_trained_policy(tmp_path):
    """rollout_engine: vllm with vllm_mode: server (here covey's own server): the worker and the trainer
    share the one server. The worker pushes each round's snapshot before the round; an evaluation, mid-run
    or after training, is sampled with the trained policy, the worker held meanwhile."""
    from transformers import TrainerCallback

    from tests.test_server import distinct_chars, serve

    tokenizer = make_tokenizer()
    server = serve(make_model(len(tokenizer), seed=6), tokenizer)  # started from other weights
    name = "model.layers.0.self_attn.q_proj.weight"
    served = []  # (greedy: an evaluation's request, the server's weights) at each completion request
    generate = server.backend.generate

    def recording(prompt_ids, n, params, seed=None):
        served.append((params.greedy, dict(server.backend.model.named_parameters())[name].detach().clone()))
        return generate(prompt_ids, n, params, seed)
    server.backend.generate = recording

    trained = []  # the trainer's weights before training and after each optimizer step (one per round)

    class Weights(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            trained.append(dict(model.named_parameters())[name].detach().clone())

    model = make_model(len(tokenizer), seed=1)
    trained.append(dict(model.named_parameters())[name].detach().clone())
    args = async_args(tmp_path, rollout_engine="vllm", vllm_mode="server", vllm_server_port=server.server_address[1],
                      vllm_server_timeout=5.0, eval_strategy="steps", eval_steps=2, gradient_accumulation_steps=1,
                      per_device_train_batch_size=8)
    try:
        trainer = GRPOTrainer(model=model, reward_funcs=[distinct_chars], args=args, train_dataset=ROWS,
                              eval_dataset=ROWS[:2], processing_class=tokenizer, callbacks=[Weights()], quiet=True)
        trainer.train()
    finally:
        server.close()
    assert len(trained) == 5 and all(not torch.equal(a, b) for a, b in zip(trained, trained[1:]))

    def which(weights):
        return next((i for i, w in enumerate(trained) if torch.equal(w, weights)), None)
    rounds = [which(w) for greedy, w in served if not greedy]
    evaluations = [which(w) for greedy, w in served if greedy]
    # one round ahead: rounds 0 and 1 from the start, then round r from the weights after r - 1 rounds
    assert rounds == [0, 0, 0, 0, 1, 1, 2, 2]  # two prompts a round, one request each
    assert evaluations == [0, 0, 2, 2, 4, 4]  # before training, at step 2, after it
