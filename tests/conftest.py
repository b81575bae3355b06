"""Shared fixtures: a tiny character-level tokenizer and a tiny random Llama, built offline."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import string
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the tests against real vLLM run in the environment that has it (make vllm-env; make test runs them there)
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]

# the tests left out of the fast tier (make test-fast): measured, one node id a line
SLOW_TESTS = frozenset(line.strip() for line in (Path(__file__).parent / "slow_tests.txt").read_text().splitlines()
                       if line.strip() and not line.startswith("#"))


def pytest_collection_modifyitems(config, items):
    root = Path(config.rootpath)
    for item in items:
        if Path(item.path).relative_to(root).as_posix() + item.nodeid[item.nodeid.index("::"):] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)

# What the tests' small runs rely on beyond their sizes, which GRPOConfig() leaves at TRL's defaults: every step
# logged, a constant learning rate, no recompute, completions recorded (the command line's demo preset does the
# same); a test that is about one of these sets it itself
SMALL_RUN = dict(logging_steps=1, lr_scheduler_type="constant", gradient_checkpointing=False, log_completions=True,
                 num_completions_to_print=4, save_total_limit=2, per_device_eval_batch_size=32)

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


# The loss every loss test starts from, written out here (core.LossSettings has no defaults: the config owns
# them): DAPO's clipped surrogate with the clip range 0.2 either way, no KL term (and, where a test turns one
# on, the GRPO paper's plain KL: no importance weight on it), every token trained, nothing else on.
PLAIN_LOSS = dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, delta=None, clip_ratio_c=None,
                  importance_sampling_level="token", beta=0.0, kl_estimator="k3", use_bias_correction_kl=False,
                  top_entropy_quantile=1.0, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                  vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, off_policy_mask_threshold=None,
                  router_aux_loss_coef=0.0)


def loss_settings(**fields):
    """``core.LossSettings`` of ``PLAIN_LOSS`` with ``fields`` over it (an entropy bonus off unless given)."""
    from covey import core

    bonus = core.EntropyBonus(coef=0.0, adaptive=False, target=0.2, delta=0.005, coef_min=0.0, coef_max=1.0)
    return core.LossSettings(**{**PLAIN_LOSS, "entropy_bonus": bonus, **fields})


def make_tokenizer():
    """Every printable character is a token; <s>/</s> frame chat turns; </s> is EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(string.printable))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                  bos_token="<s>", eos_token="</s>")
    tok.add_special_tokens({"additional_special_tokens": []})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(vocab_size: int, seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=2, eos_token_id=3, pad_token_id=0, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def trained_lora(model, targets, r: int = 4):
    """``model`` with a LoRA adapter on ``targets`` whose B matrices are nonzero, as after training."""
    from covey.models import add_lora

    policy = add_lora(model, r=r, alpha=2 * r, dropout=0.0, target_modules=targets)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name or "lora_embedding_" in name:  # one of each pair starts at zero: give it an effect
                param.normal_(0.0, 0.3)
    return policy.eval()


@pytest.fixture
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    return make_model(len(tokenizer))


@pytest.fixture
def tiny_model_dir(tmp_path, tokenizer):
    """A tiny Llama saved as a Hugging Face folder, as a user's local model would be."""
    folder = tmp_path / "tiny-llama"
    make_model(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def scored_batch(trainer, indices):
    """Steps 1-4 of a training step on the training rows at ``indices``, with the step's own functions:
    the scored batch and the log-probs held fixed over its optimizer steps."""
    from covey.train.rounds import generate_and_score, with_advantages
    from covey.train.update import fixed_logprobs

    parts = trainer.parts
    batch, _ = with_advantages(parts, generate_and_score(parts, trainer.prompt_sampler, trainer.progress, indices).samples)
    return batch, fixed_logprobs(parts, batch)


def optimize(trainer, batch, fixed):
    """Steps 5-6 on the whole batch as the step's first optimizer step (the policy still the one that
    sampled); the loss statistics with the gradient norm. The trainer's progress moves on by the step."""
    from covey.train.update import optimizer_step

    totals, grad_norm, progress = optimizer_step(trainer.parts, batch, fixed, slice(0, batch.samples.size), True,
                                                 trainer.progress)
    trainer.run_state = dataclasses.replace(trainer.run_state, progress=progress)
    return {**totals, "grad_norm": grad_norm}
