"""vllm_mode: server with a vision-language model: vLLM's server (started by covey server --backend vllm) is
given each prompt's pictures with its token ids, and samples with the log-probs of the trainer's forward on
the same pictures, before training and after a run through the server pushed the trained weights (the vision
tower's too), and in episodes whose later turn follows a tool's message that shows a picture. On a tiny Idefics3 (SmolVLM's architecture) saved to a folder, as vLLM loads one."""

from __future__ import annotations

import json

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.data import load_rows
from covey.data.text import encode_prompts
from covey.rollout import SamplingParams, ServerEngine, left_pad
from covey.train.forward import SequenceBatch, completion_logprobs
from covey.vision import batch_images, placeholder_token_ids
from tests.tiny_vision import image, saved
from tests.vllm.test_server_mode import Server
from tests.vllm.tool_pictures import end_turns_early, episode_gap


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return saved("idefics3", tmp_path_factory.mktemp("tiny-smolvlm"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, folder):
    server = Server.start(folder, tmp_path_factory.mktemp("server") / "server.log", "--vllm-gpu-memory-utilization",
                          "0.02", "--max-prompt-length", "128", "--max-completion-length", "64")
    yield server
    server.kill()


@pytest.fixture(scope="module")
def vlm(folder):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)


def picture_rows(seeds) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"What is in picture {i}?"}], "image": image(seed)}
            for i, seed in enumerate(seeds)]


def encoded(processor, rows) -> list[list[int]]:
    return encode_prompts(processor.tokenizer, [row["prompt"] for row in load_rows(rows)], 128, processor=processor)


def trainer_logprobs(model, prompt_ids: list[list[int]], rollout, params: SamplingParams) -> torch.Tensor:
    """The trainer's log-prob of each sampled token (G = 2 per prompt), on the pictures ``prompt_ids`` carry."""
    repeated = [ids for ids in prompt_ids for _ in range(2)]
    prompt_BP, mask_BP = left_pad(repeated, 0)
    sequences = SequenceBatch(prompt_BP, mask_BP, rollout.completion_ids_BT, rollout.completion_mask_BT,
                              batch_images(repeated))
    with torch.no_grad():
        return completion_logprobs(model.eval(), sequences, params.distribution)[0]


def gap(rollout, want: torch.Tensor) -> float:
    mask = rollout.completion_mask_BT.bool()
    return float((rollout.sampling_logp_BT - want).abs()[mask].max())


def test_the_server_samples_prompts_with_pictures_with_the_trainer_s_log_probs(server, vlm):
    model, processor = vlm
    params = SamplingParams(max_new_tokens=8, suppress=tuple(placeholder_token_ids(model.config)))
    ids, others = encoded(processor, picture_rows([0, 1])), encoded(processor, picture_rows([10, 11]))
    assert [list(a) for a in ids] == [list(b) for b in others]  # the same tokens, other pixels
    engine = ServerEngine("127.0.0.1", server.port, 0, [3], timeout=60, policy=model)  # its weights pushed first
    assert engine.takes_images
    before = server.requests("/inference/v1/generate")
    rollout = engine.generate(ids, 2, params, seed=3)
    assert server.requests("/inference/v1/generate") == before + 2  # one request per prompt, with its pictures
    same, other = (gap(rollout, trainer_logprobs(model, p, rollout, params)) for p in (ids, others))
    print(f"pictures: largest gap {same:.3g} to the trainer's on the same pictures, {other:.3g} on others")
    assert same < 1e-3
    assert other > 1e-2  # the server read these pictures: the log-probs on others are not what it sampled with
    text = [processor.tokenizer.apply_chat_template([{"role": "user", "content": "What is it?"}], tokenize=True,
                                                    add_generation_prompt=True, return_dict=False)]
    plain = engine.generate(text, 2, params, seed=4)  # a prompt without pictures, through /v1/completions
    assert gap(plain, trainer_logprobs(model, text, plain, params)) < 1e-3


def test_episodes_whose_tool_shows_a_picture_are_sampled_with_the_trainer_s_log_probs(server, vlm):
    import copy

    model, processor = vlm
    policy = copy.deepcopy(model)
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": "What is it?"}], tokenize=True,
                                                   add_generation_prompt=True, return_dict=False)
    end_turns_early(policy, text, 3)
    engine = ServerEngine("127.0.0.1", server.port, 0, [3], timeout=60, policy=policy)  # its weights pushed first
    params = SamplingParams(max_new_tokens=8, suppress=tuple(placeholder_token_ids(model.config)))
    largest, later = episode_gap(engine, policy, processor, encoded(processor, picture_rows([0, 1])), params, [3], 6,
                                 image(9))
    print(f"episodes: largest gap {largest:.3g} to the trainer's; {later} of 4 rows with a turn after the tool's")
    assert largest < 1e-3 and later > 0


def test_a_run_through_the_server_trains_on_pictures_and_the_server_samples_with_the_trained_weights(
        server, vlm, folder, tmp_path):
    from transformers import AutoModelForImageTextToText

    model, processor = vlm
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, learning_rate=1e-2, logging_steps=1, max_steps=2, report_to="none",
                      seed=0, use_vllm=True, vllm_mode="server", vllm_server_port=server.port,
                      vllm_server_timeout=60, max_prompt_length=128, eval_max_samples=0)
    before = server.requests("/inference/v1/generate")
    trainer = GRPOTrainer(model=AutoModelForImageTextToText.from_pretrained(folder),
                          reward_funcs=lambda completions, **kw: [-abs(5 - len(c[0]["content"])) for c in completions],
                          args=args, train_dataset=picture_rows(range(4)), processing_class=processor)
    engine = trainer.parts.sampler.engine
    assert type(engine).__name__ == "ServerEngine"
    trainer.train()
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and server.requests("/inference/v1/generate") >= before + 2
    engine.policy_changed(trainer.model)  # the trained weights pushed at the next generation
    params, ids = trainer.parts.sampler.sampling, trainer.parts.prompts.ids[:2]
    rollout = engine.generate(ids, 2, params, seed=5)
    trained, untrained = (gap(rollout, trainer_logprobs(m, ids, rollout, params)) for m in (trainer.model, model))
    print(f"after training: largest gap {trained:.3g} to the trained policy's, {untrained:.3g} to the untrained one's")
    assert trained < 1e-3
    assert untrained > 1e-2  # the weights trained and were pushed
