"""The examples run: each config for one short step (on a tiny model, so the suite stays fast), the reward
functions on their own, and the TRL script through `covey verify --trl`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from covey.cli import main
from covey.config import DEMO, GRPOConfig
from covey.rewards import load_reward_func

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GSM8K_ROWS = [{"question": f"Tom has {a} apples and buys {a + 1} more. How many does he have?",
               "answer": f"{a} + {a + 1} = {2 * a + 1}\n#### {2 * a + 1}"} for a in range(1, 5)]
SHORT = ["--max-steps", "1", "--num-generations", "2", "--per-device-train-batch-size", "4",
         "--gradient-accumulation-steps", "1", "--max-completion-length", "8", "--eval-max-samples", "2",
         "--log-completions", "false"]


@pytest.mark.parametrize("name", ["gsm8k.yaml", "demo.yaml", "arithmetic_lora.yaml", "multiplication_tool.yaml"])
def test_each_example_config_trains_a_step(tmp_path, tiny_model_dir, name):
    """Every setting of the example runs; only the model, the size of the run and (for GSM8K, whose data is
    not shipped) the data files are replaced."""
    data = []
    if name == "gsm8k.yaml":
        rows = tmp_path / "gsm8k.jsonl"
        rows.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
        data = ["--dataset", str(rows), "--eval-dataset", str(rows)]
    GRPOConfig.from_yaml(EXAMPLES / name)  # as written
    run = tmp_path / "run"
    assert main(["train", str(EXAMPLES / name), "--model", str(tiny_model_dir), "--output-dir", str(run),
                 *SHORT, *data]) == 0
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == [1]
    config = GRPOConfig.from_yaml(EXAMPLES / name)
    assert [name for name in logged[0] if name.startswith("rewards/") and name.endswith("/mean")] == [
        f"rewards/{Path(func).name.split(':')[-1]}/mean" for func in config.reward_funcs]


def test_the_demo_example_is_the_command_line_s_preset():
    assert GRPOConfig.from_yaml(EXAMPLES / "demo.yaml") == GRPOConfig.from_dict(DEMO)


def test_example_rewards():
    brevity = load_reward_func(f"{EXAMPLES / 'rewards.py'}:brevity")
    assert brevity(completions=[[{"role": "assistant", "content": "x" * 50}]]) == [-0.5]
    units = load_reward_func(f"{EXAMPLES / 'rewards.py'}:mentions_units")
    assert units(completions=["12 km", "12"], unit=["km", None]) == [1.0, None]


def test_the_trl_example_script_passes_covey_verify(tmp_path):
    """examples/trl_grpo.py, TRL's own GRPOTrainer on the default model, through every stage check."""
    done = subprocess.run([sys.executable, "-m", "covey", "verify", "--trl", str(EXAMPLES / "trl_grpo.py"),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "every stage passed" in done.stdout
    out = tmp_path / "out"  # TRL's trainer makes the folder when it is built; verify writes nothing in it
    assert not out.exists() or not any(out.iterdir())
