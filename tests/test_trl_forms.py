"""TRL's own forms run unchanged: a recipe YAML as `trl grpo --config` reads it (model arguments, script
arguments and GRPO fields together), and a script written for TRL's GRPOTrainer with only its import
changed. And docs/trl.md's table gives every TRL GRPOConfig field the status the code gives it."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from covey import GRPOConfig, trl_fields
from tests.test_lifecycle import FakeHub

# A recipe in the form of TRL's and open-r1's GRPO recipes; only the model path, the dataset and the run
# folder are filled in by the test
RECIPE = """\
# Model arguments
model_name_or_path: {model}
model_revision: main
torch_dtype: bfloat16
attn_implementation: sdpa
use_peft: true
lora_r: 8
lora_alpha: 16
lora_target_modules: [q_proj, k_proj, v_proj, o_proj]
lora_task_type: CAUSAL_LM

# Data training arguments
dataset_name: {dataset}
dataset_train_split: train
system_prompt: "You are a helpful assistant. Think first in <think></think> tags, then give the answer."

# GRPO trainer config
bf16: true
use_vllm: false
do_eval: false
gradient_accumulation_steps: 2
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
hub_model_id: tiny-grpo
hub_strategy: every_save
learning_rate: 3.0e-06
log_completions: true
log_level: info
logging_first_step: true
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine
max_prompt_length: 512
max_completion_length: 64
max_steps: -1
num_generations: 8
num_train_epochs: 1
output_dir: {output}
overwrite_output_dir: true
per_device_eval_batch_size: 16
per_device_train_batch_size: 8
push_to_hub: true
report_to:
- none
reward_funcs:
- accuracy_reward
- think_format_reward
reward_weights:
- 1.0
- 1.0
save_strategy: "epoch"
save_total_limit: 1
seed: 42
warmup_ratio: 0.1
beta: 0.04
epsilon_high: 0.28
loss_type: dapo
scale_rewards: group
mask_truncated_completions: true
"""


def test_a_trl_recipe_runs_with_only_the_model_and_the_dataset_changed(tmp_path, tiny_model_dir, monkeypatch):
    pytest.importorskip("math_verify", reason="accuracy_reward compares with math-verify (covey[math])")
    from covey.cli import main

    dataset = tmp_path / "math.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}],
                                           "solution": f"${2 * a}$"}) + "\n" for a in range(8)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=tiny_model_dir, dataset=dataset, output=tmp_path / "run"))
    hub = FakeHub(monkeypatch)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "run"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # 8 prompts, 2 a round: one epoch is 4 optimizer steps
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (saved["model"], saved["dtype"], saved["dataset"], saved["save_strategy"]) == (
        str(tiny_model_dir), "bfloat16", str(dataset), "epoch")
    assert [path.name for path in (run / "checkpoints").iterdir()] == ["checkpoint-4"]  # the end of the epoch
    assert (run / "final_model" / "adapter_config.json").is_file()
    assert [u["message"] for u in hub.uploads][-1] == "End of training"
    assert {u["repo"] for u in hub.uploads} == {"someone/tiny-grpo"}


SCRIPT = """\
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

MODEL = {model!r}


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]


class StopAfter(TrainerCallback):
    def __init__(self, steps):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.steps:
            control.should_training_stop = True
        return control


if __name__ == "__main__":
    dataset = Dataset.from_list([{{"prompt": [{{"role": "user", "content": f"Write about {{topic}}."}}]}}
                                 for topic in ("cats", "dogs", "rain", "tea", "maps", "bees", "jazz", "snow")])
    training_args = GRPOConfig(output_dir={output!r}, per_device_train_batch_size=4, num_generations=4,
                               max_completion_length=16, learning_rate=1e-4, logging_steps=1, max_steps=10,
                               report_to="none", seed=0)
    trainer = GRPOTrainer(
        model=MODEL,
        reward_funcs=reward_len,
        args=training_args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(MODEL),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        callbacks=[StopAfter(2)],
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name="topics")
"""


def test_a_trl_script_runs_with_only_its_import_changed(tmp_path, tiny_model_dir):
    script = tmp_path / "train_grpo.py"
    text = SCRIPT.format(model=str(tiny_model_dir), output=str(tmp_path / "run"))
    assert "from trl import GRPOConfig, GRPOTrainer" in text
    script.write_text(text.replace("from trl import GRPOConfig, GRPOTrainer", "from covey import GRPOConfig, GRPOTrainer"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # the callback stopped the run of 10 steps after the second
    adapter = json.loads((run / "final_model" / "adapter_config.json").read_text())
    assert (adapter["r"], sorted(adapter["target_modules"])) == (4, ["q_proj", "v_proj"])


def trl_field_status(name: str) -> str:
    if name in {f.name for f in dataclasses.fields(GRPOConfig)}:
        return "supported"
    if name in trl_fields.SAME_AS or name in trl_fields.READ_AS:
        return "read as"
    return "accepted" if name in trl_fields.AS_COVEY_DOES else "refused"


def test_the_docs_table_gives_every_trl_field_the_status_the_code_gives_it():
    table = {}
    text = (Path(__file__).parent.parent / "docs" / "trl.md").read_text()
    section = text.split("## Every field of TRL 1.16's GRPOConfig", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        if line.startswith("| `"):
            name, status, note = (cell.strip() for cell in line.strip("|").split("|", 2))
            table[name.strip("`")] = (status, note)
    assert set(table) == set(trl_fields.TRL_FIELDS)
    wrong = {name: status for name, (status, _) in table.items() if status != trl_field_status(name)}
    assert not wrong, f"docs/trl.md disagrees with the code: {wrong}"
    assert all(note for status, note in table.values() if status in ("refused", "accepted", "read as"))


def test_save_model_and_push_to_hub_as_trl_scripts_call_them(tmp_path, tokenizer, tiny_model):
    from covey import GRPOTrainer
    from covey.errors import ConfigError
    from tests.test_trainer import ROWS, count_a, small_args

    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[count_a], args=small_args(tmp_path, max_steps=1,
                          eval_max_samples=0), train_dataset=ROWS, processing_class=tokenizer, quiet=True)
    trainer.train()
    assert trainer.save_model(tmp_path / "run") == tmp_path / "run" / "final_model"  # written by train()
    copy = trainer.save_model(tmp_path / "elsewhere")
    assert (copy / "model.safetensors").is_file() and (copy / "tokenizer_config.json").is_file()
    with pytest.raises(ConfigError, match="already holds files, and covey overwrites nothing"):
        trainer.save_model(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="set push_to_hub: true"):
        trainer.push_to_hub()
