"""Rebuild tests/data/trl-run: a run made by TRL's own ``trl.GRPOTrainer`` (not covey's), for the
test that ``covey diagnose`` reads a TRL output directory as TRL writes it.

The run: a tiny random-weight Llama (hidden size 32, the test suite's one-token-per-character tokenizer),
sums a + b as plain-text prompts, two reward functions:

    length_bonus   hackable: the completion's length in characters over 64, whatever it says
    sum_correct    honest: 1 where the last number of the completion is the sum, else 0

A random model almost never writes the right sum, so the honest reward stays at about 0, and the one thing
the policy can learn is to stop ending its completions early (the end-of-text token is one of ~100 it
samples): the length bonus rises, and with it the total reward, on length alone. That is the expected
verdict, written here from the setup: ``gaming the reward`` (the reward pays for length).

    python -m benchmarks.trl_run_fixture --out /tmp/trlrun

trains in a scratch folder (the model weights and checkpoints stay there), then copies the files covey
diagnose reads (trainer_state.json, completions/*.parquet) into tests/data/trl-run.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import string
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "trl-run"
MAX_COMPLETION_LENGTH = 64


def length_bonus(completions, **kwargs):
    """Hackable: pays for length alone."""
    return [len(c) / MAX_COMPLETION_LENGTH for c in completions]


def sum_correct(completions, answer, **kwargs):
    """Honest: the last number written is the sum."""
    scores = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"\d+", completion)
        scores.append(float(bool(numbers) and numbers[-1] == expected))
    return scores


def tokenizer():
    """One token per printable character, <s> and </s> around a text, </s> the end of text (the test
    suite's tokenizer, tests/conftest.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<unk>", "<s>", "</s>"] + list(string.printable))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/trlrun", help="scratch folder TRL trains in (outside the repository)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    if ROOT in out.parents or out == ROOT:
        sys.exit(f"--out {out} is inside the repository; give a scratch folder outside it")

    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    tok = tokenizer()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         bos_token_id=2, eos_token_id=3, pad_token_id=0, tie_word_embeddings=True))
    rng = random.Random(args.seed)
    pairs = [(rng.randint(0, 12), rng.randint(0, 12)) for _ in range(256)]
    data = Dataset.from_list([{"prompt": f"{a} + {b} = ", "answer": str(a + b)} for a, b in pairs])
    config = GRPOConfig(output_dir=str(out), max_steps=args.steps, learning_rate=3e-2, per_device_train_batch_size=8,
                        num_generations=8, max_completion_length=MAX_COMPLETION_LENGTH, logging_steps=1,
                        log_completions=True, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
                        temperature=1.0, beta=0.0, seed=args.seed, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[length_bonus, sum_correct], args=config, train_dataset=data,
                          processing_class=tok)
    trainer.train()
    trainer.save_state()

    if FIXTURE.exists():
        shutil.rmtree(FIXTURE)
    (FIXTURE / "completions").mkdir(parents=True)
    shutil.copy(out / "trainer_state.json", FIXTURE / "trainer_state.json")
    for parquet in sorted((out / "completions").glob("*.parquet")):
        shutil.copy(parquet, FIXTURE / "completions" / parquet.name)
    size = sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file())
    print(f"wrote {FIXTURE} ({size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
