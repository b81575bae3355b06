"""Fixtures of the tests against real vLLM (its CPU build, in the environment ``make vllm-env`` makes):
the default model as the folder vLLM loads, chat prompts, the trainer's own log-probs and greedy
completions to compare vLLM's with, and one colocated vLLM engine for the whole session (vLLM's start
compiles for a minute or two, and a process holds one)."""

from __future__ import annotations

import os

import pytest
import torch

from covey.models import embedded_model_folder, load_policy, load_tokenizer
from covey.rollout import HFEngine, SamplingParams
from covey.rollout.engine import EngineSettings

QUESTIONS = ["What is 2 + 3?", "Name a colour.", "Write one word that rhymes with cat.", "What is 7 times 6?"]
GREEDY = SamplingParams(max_new_tokens=24, greedy=True)
PROCESS_GROUP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ENV_AT_START = {key: os.environ.get(key) for key in PROCESS_GROUP_ENV}  # before any engine was built
NEAR_TIE = 1e-3  # a log-prob margin this small between two tokens may order them either way in other kernels


@pytest.fixture(scope="session")
def model_folder() -> str:
    return str(embedded_model_folder())


@pytest.fixture(scope="session")
def default_tokenizer(model_folder):
    return load_tokenizer(model_folder)


@pytest.fixture(scope="session")
def prompts(default_tokenizer) -> list[list[int]]:
    return [default_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS]


@pytest.fixture
def policy(model_folder):
    return load_policy(model_folder).eval()


def engine_settings(**changes) -> EngineSettings:
    # vllm_gpu_memory_utilization on a CPU: the share of the machine's memory for vLLM's KV cache
    return EngineSettings(dtype="float32", seed=0, max_model_len=512, gpu_memory_utilization=0.03, **changes)


@pytest.fixture(scope="session")
def colocated(model_folder, default_tokenizer):
    from covey.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(engine_settings(), default_tokenizer.pad_token_id, [default_tokenizer.eos_token_id],
                      model_path=model_folder)


def trainer_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The trainer's float32 log-prob of each completion token (temperature 1)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def completions(rollout) -> list[list[int]]:
    return [rollout.completion_ids_BT[row, :int(n)].tolist() for row, n in enumerate(rollout.lengths_B)]


def largest_logprob_gap(model, prompts, rollout, num_generations: int = 1) -> float:
    """The largest difference between the engine's log-prob of a sampled token and the trainer's."""
    gap = 0.0
    for row, completion in enumerate(completions(rollout)):
        if completion:
            want = trainer_logprobs(model, prompts[row // num_generations], completion)
            gap = max(gap, float((rollout.sampling_logp_BT[row, :len(completion)] - want).abs().max()))
    return gap


def assert_greedy_of(model, prompts, rollout, eos_token_ids) -> None:
    """``rollout`` (one greedy completion per prompt) is ``model``'s greedy output: token for token, or
    parting from it only where the trainer's two best tokens are a near-tie."""
    want = completions(HFEngine(model, 0, eos_token_ids).generate(prompts, 1, GREEDY))
    for prompt, got, wanted in zip(prompts, completions(rollout), want):
        if got == wanted:
            continue
        at = next((i for i, (a, b) in enumerate(zip(got, wanted)) if a != b), min(len(got), len(wanted)))
        assert at < min(len(got), len(wanted)), f"one greedy completion is a prefix of the other: {got} vs {wanted}"
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + wanted[:at]])).logits[0, -1].float()
        logp = torch.log_softmax(logits, -1)
        margin = float(logp[wanted[at]] - logp[got[at]])
        assert margin < NEAR_TIE, (f"vLLM's greedy completion parts from the trainer model's at token {at} where "
                                   f"the trainer prefers its token by {margin:.3g} nats: {got} vs {wanted}")
