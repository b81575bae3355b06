"""The example configs and reward functions stay valid."""

from pathlib import Path

import pytest

from covey.config import GRPOConfig
from covey.rewards import load_reward_func

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", ["gsm8k.yaml", "arithmetic_lora.yaml"])
def test_example_configs_are_valid(name):
    GRPOConfig.from_yaml(EXAMPLES / name)


def test_example_rewards():
    brevity = load_reward_func(f"{EXAMPLES / 'rewards.py'}:brevity")
    assert brevity(completions=[[{"role": "assistant", "content": "x" * 50}]]) == [-0.5]
    units = load_reward_func(f"{EXAMPLES / 'rewards.py'}:mentions_units")
    assert units(completions=["12 km", "12"], unit=["km", None]) == [1.0, None]
