"""A toy task where learning is certain: reward the letter 'a'. Reward must rise within a minute."""

import json

from covey import GRPOConfig, GRPOTrainer
from tests.conftest import make_model


def fraction_of_a(completions, **kwargs):
    return [c.count("a") / max(len(c), 1) for c in completions]


def test_reward_rises_on_a_toy_task(tmp_path, tokenizer):
    model = make_model(len(tokenizer), seed=0)
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=40, num_generations=8,
                      per_device_train_batch_size=16, max_completion_length=6, learning_rate=1e-2,
                      eval_max_samples=0, temperature=1.0, log_completions=False, logging_steps=1,
                      lr_scheduler_type="constant", gradient_checkpointing=False)
    rows = [{"prompt": p} for p in ("hello", "world", "grpo", "tiny")]
    GRPOTrainer(model=model, reward_funcs=[fraction_of_a], args=args, train_dataset=rows,
                processing_class=tokenizer, quiet=True).train()
    rewards = [json.loads(line)["reward"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.1, f"untrained model already writes 'a' often: {first:.3f}"
    assert last > first + 0.3, f"reward did not rise: first {first:.3f}, last {last:.3f}"
