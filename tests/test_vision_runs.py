"""Pictures through the paths text runs take: asynchronous generation, resume from a checkpoint, two processes
(DDP and FSDP2), on the cheapest family of tests/tiny_vision.py, Idefics3 (one image token per picture); and
pictures a tool or an environment returns, seen by the later turns and every log-prob pass, on every family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.data.text import encode_prompts
from covey.errors import ConfigError
from covey.rollout import HFEngine, Rollout
from covey.train.forward import completion_logprobs
from covey.train.sharding import whole
from covey.vision import image_label, images_of
from covey.vision.fit import feature_count, image_token_id
from tests.conftest import SMALL_RUN, scored_batch
from tests.test_agents import ScriptedAgent
from tests.test_checkpoint import assert_same_weights, learned_metrics
from tests.test_distributed import ScriptedEngine, as_launched, free_port, run_in_two_processes
from tests.tiny_vision import BUILDERS, FAMILIES, IDS, image


def picture_rows(n: int = 8) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"What is in picture {i}?"}], "image": image(i)} for i in range(n)]


def spread(completions, **kwargs):
    """Rewards that differ within a group: longer completions, and some characters, score higher."""
    return [(len(text) + sum(map(ord, text)) % 5) / 8 for text in (c[0]["content"] for c in completions)]


def run_args(out: Path, **changes) -> GRPOConfig:
    values = dict(output_dir=str(out), max_steps=4, num_generations=4, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, max_completion_length=6, learning_rate=1e-2, seed=3,
                  eval_max_samples=0, eval_strategy="no", rollout_engine="hf")
    return GRPOConfig(**{**SMALL_RUN, **values, **changes})


def train(args: GRPOConfig) -> GRPOTrainer:
    model, processor = BUILDERS["idefics3"]()
    trainer = GRPOTrainer(model=model, reward_funcs=[spread], args=args, train_dataset=picture_rows(),
                          processing_class=processor, quiet=True)
    trainer.train()
    return trainer


def test_an_async_run_samples_each_round_with_its_prompts_pictures(tmp_path, monkeypatch):
    shown = []  # the pictures of every prompt the engines sampled
    generate = HFEngine.generate

    def recording(self, prompt_ids, *args, **kwargs):
        shown.append([None if images_of(ids) is None else [image_label(p) for p in images_of(ids).pictures]
                      for ids in prompt_ids])
        return generate(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", recording)
    trainer = train(run_args(tmp_path / "run", async_generation=True))
    assert trainer.global_step == 4
    pictures = {image_label(image(i)) for i in range(8)}
    assert len(shown) == 4 and all(labels is not None and len(labels) == 1 and labels[0] in pictures
                                   for call in shown for labels in call)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "async/staleness" in m]
    assert [m["async/staleness"] for m in steps] == [0.0, 1.0, 1.0, 1.0]
    # the first round was sampled by the starting policy, which the trainer's log-probs are of: the engine's
    # log-probs are the trainer's (the worker saw the pictures), and its correction weighs every token 1
    assert steps[0]["engine_is/mean_weight"] == pytest.approx(1.0, abs=1e-4)
    assert steps[0]["engine_is/masked_fraction"] == 0.0
    assert steps[1]["engine_is/mean_weight"] != pytest.approx(1.0, abs=1e-4)  # sampled by a policy since moved


@pytest.mark.parametrize("variant", [dict(), dict(async_generation=True)], ids=["sync", "async"])
def test_resume_with_pictures_is_bitwise_the_uninterrupted_run(tmp_path, variant):
    train(run_args(tmp_path / "whole", save_steps=2, save_total_limit=None, **variant))
    checkpoint = tmp_path / "whole" / "checkpoints" / "checkpoint-2"
    model, processor = BUILDERS["idefics3"]()
    resumed = GRPOTrainer(model=model, reward_funcs=[spread], train_dataset=picture_rows(), processing_class=processor,
                          args=run_args(tmp_path / "resumed", save_steps=2, resume_from_checkpoint=str(checkpoint),
                                        **variant), quiet=True)
    assert resumed.global_step == 2
    from transformers import AutoProcessor  # a checkpoint's model folder loads on its own, processor included

    assert type(AutoProcessor.from_pretrained(checkpoint / "model")) is type(processor)
    resumed.train()
    assert_same_weights(tmp_path / "whole" / "final_model", tmp_path / "resumed" / "final_model")
    assert learned_metrics(tmp_path / "whole") == learned_metrics(tmp_path / "resumed")


# ---- two processes ---------------------------------------------------------------------------------------


class ScriptedPictures(ScriptedEngine):
    """The two-process tests' scripted completions, for prompts that must show their pictures."""

    takes_images = True

    def generate(self, prompt_ids, num_generations, params, seed=None):
        assert all(images_of(ids) is not None for ids in prompt_ids), "a prompt reached the engine without its pictures"
        return super().generate(prompt_ids, num_generations, params, seed)


def train_scripted(output_dir: Path, processes: int, **changes) -> dict:
    """A run of 2 steps (2 prompts with pictures x 4 scripted completions each, one micro-batch of 4 per process and
    accumulation step); the whole gradient each optimizer step saw."""
    model, processor = BUILDERS["idefics3"](seed=1)
    args = run_args(output_dir, max_steps=2, gradient_accumulation_steps=2 // processes, beta=0.04, **changes)
    trainer = GRPOTrainer(model=model, reward_funcs=[spread], args=args, train_dataset=picture_rows(),
                          processing_class=processor, rollout_engine=ScriptedPictures(processor.tokenizer), quiet=True)
    gradients, step = [], trainer.optimizer.step

    def recording_step(*args, **kwargs):
        gradients.append([whole(p.grad).clone() for p in trainer.model.parameters() if p.grad is not None])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    trainer.train()
    return {"gradients": gradients}


def _scripted_process(rank: int, port: int, output_dir: str, results: str, changes: dict) -> None:
    as_launched(rank, port)
    torch.set_num_threads(1)
    torch.save(train_scripted(Path(output_dir), 2, **changes), f"{results}-{rank}.pt")


@pytest.mark.parametrize("changes", [{}, {"fsdp": "full_shard"}], ids=["ddp", "fsdp2"])
def test_two_processes_make_the_update_one_process_makes_on_prompts_with_pictures(tmp_path, changes):
    one = train_scripted(tmp_path / "one", 1)["gradients"]
    results = str(tmp_path / "results")
    run_in_two_processes(_scripted_process, (free_port(), str(tmp_path / "two"), results, changes))
    two = [torch.load(f"{results}-{rank}.pt")["gradients"] for rank in (0, 1)]
    assert len(one) == len(two[0]) == len(two[1]) == 2
    for step in range(2):
        assert len(one[step]) == len(two[0][step]) > 0
        for single, rank0, rank1 in zip(one[step], two[0][step], two[1][step]):
            assert torch.equal(rank0, rank1)  # every process takes the same update
            assert torch.allclose(single, rank0, atol=1e-6, rtol=1e-4)
    one_metrics, two_metrics = (learned_metrics(tmp_path / run) for run in ("one", "two"))
    for key in ("reward", "loss", "kl", "entropy", "grad_norm"):
        assert [m[key] for m in two_metrics] == pytest.approx([m[key] for m in one_metrics], rel=1e-4, abs=1e-7), key
    completions = [json.loads(line) for line in (tmp_path / "two" / "completions.jsonl").read_text().splitlines()]
    first_step = [c for c in completions if c["step"] == 1]
    assert len(first_step) == 8 and len({str(c["prompt"]) for c in first_step}) == 2  # each process a prompt


# ---- pictures in tool and environment messages --------------------------------------------------------------


def look() -> list:
    """Look at the scene."""
    return [{"type": "image", "image": image(9)}, {"type": "text", "text": "the scene"}]


class Scene:
    """An environment in TRL's convention whose tool shows a picture."""

    def reset(self, **row) -> None:
        return None

    def look(self) -> list:
        """Look at the scene."""
        return look()


LOOK = '<tool_call>{"name": "look", "arguments": {}}</tool_call>'


def calls_look_first(tokenizer):
    """``HFEngine.generate``, but every episode's first turn calls the tool look: the later turns are the model's own
    samples, drawn with every picture the episode shows (the prompt's and the tool's)."""
    sample, call = HFEngine.generate, tokenizer.encode(LOOK, add_special_tokens=False) + [tokenizer.eos_token_id]

    def generate(engine, prompt_ids, num_generations, params, seed=None):
        if "<s>tool\n" in tokenizer.decode(prompt_ids[0]):  # after the tool's message
            return sample(engine, prompt_ids, num_generations, params, seed)
        ids_BT = torch.tensor([call] * (len(prompt_ids) * num_generations))
        return Rollout(ids_BT, torch.ones_like(ids_BT), torch.zeros(ids_BT.shape), ["eos"] * len(ids_BT))

    return generate


def shown_to_rewards(completions, **kwargs):
    """The tool's message reaches reward functions as TRL gives it: its content parts, the picture opened."""
    for messages in completions:
        parts = messages[1]["content"]
        assert messages[1]["role"] == "tool" and image_label(parts[0]["image"]) == image_label(image(9))
        assert parts[1] == {"type": "text", "text": "the scene"}
    return spread([[m] for m in (messages[-1] for messages in completions)])


def plain_later_logprobs(model, processor, sequences, b: int, tool_picture, prompt_picture) -> torch.Tensor:
    """The log-probs of row ``b``'s completion under the model's own forward of the whole row, with the pixel
    inputs of its two pictures (the prompt's, then ``tool_picture``) from the processor given both at once, and
    each token field 1 on the image tokens (built apart from covey)."""
    prompt = sequences.prompt_ids_BP[b][sequences.prompt_mask_BP[b].bool()]
    completion = sequences.completion_ids_BT[b][sequences.completion_mask_BT[b].bool()]
    ids = torch.cat([prompt, completion])[None]
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
                                         tokenize=False)
    out = processor(text=[text], images=[[prompt_picture, tool_picture]], return_tensors="pt")
    inputs = {key: value for key, value in out.items() if key not in ("input_ids", "attention_mask")}
    for key, value in inputs.items():
        if value.shape == out["input_ids"].shape:  # a field of each token
            inputs[key] = (ids == image_token_id(model.config)).to(value.dtype)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, completion[:, None])[:, 0]


def encoded_alone(processor, picture):
    """A prompt of one picture encoded by covey, for its pixel inputs."""
    return encode_prompts(processor.tokenizer, [[{"role": "user", "content": [{"type": "image", "image": picture}]}]],
                          512, processor=processor)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_picture_a_tool_returns_is_seen_by_later_turns_and_every_log_prob_pass(tmp_path, monkeypatch, family):
    model, processor = BUILDERS[family]()
    with torch.no_grad():  # later turns end soon: the model's end token made likely
        model.get_output_embeddings().weight[IDS["eos_token_id"]] *= 6.0
    monkeypatch.setattr(HFEngine, "generate", calls_look_first(processor.tokenizer))
    trainer = GRPOTrainer(model=model, reward_funcs=[shown_to_rewards], train_dataset=picture_rows(2),
                          processing_class=processor, tools=[look], quiet=True,
                          args=run_args(tmp_path, num_generations=2, max_completion_length=120, max_prompt_length=1024))
    batch, _ = scored_batch(trainer, [0, 1])
    samples, sequences = batch.samples, batch.samples.sequences
    token = image_token_id(model.config)
    tool_picture = image(9)
    features = feature_count(model, images_of(encoded_alone(processor, tool_picture)).tensors)
    for b in range(4):
        pictures = sequences.images[b]
        assert pictures.labels == (image_label(image(b // 2)), image_label(tool_picture))
        completion = sequences.completion_ids_BT[b][sequences.completion_mask_BT[b].bool()]
        # the tool message holds the tool picture's image tokens, one per feature, never trained
        written = completion[~samples.loss_mask_BT[b][:len(completion)].bool()]
        assert completion.tolist().count(token) == written.tolist().count(token) == features > 0
        assert "[image:" in samples.records[b]["completion"]  # the transcript names the picture
    # the tokens the model sampled after the first turn (the call, at most one token per character, and its end)
    later = samples.loss_mask_BT.bool() & (torch.arange(samples.loss_mask_BT.shape[1]) > len(LOOK))
    assert later.any(), "no episode had a turn after the tool's message"
    with torch.no_grad():  # sampling saw what every log-prob pass sees
        logp, _ = completion_logprobs(model, sequences, trainer.parts.sampler.sampling.distribution)
        raw, _ = completion_logprobs(model, sequences)
    assert float((logp - samples.sampling_logp_BT).abs()[later].max()) < 1e-4
    for b in range(4):  # and that is the model's own forward with both pictures; other pixels change it
        n = int(sequences.completion_mask_BT[b].sum())
        turn = later[b, :n]
        if not turn.any():
            continue
        plain = plain_later_logprobs(model, processor, sequences, b, tool_picture, image(b // 2))
        assert float((plain - raw[b, :n]).abs()[turn].max()) < 1e-4
        other = plain_later_logprobs(model, processor, sequences, b, image(10), image(b // 2))
        assert float((other - raw[b, :n]).abs()[turn].max()) > 1e-3


@pytest.mark.parametrize("handed,changes", [(dict(tools=[look]), {}), (dict(environment_factory=Scene), {}),
                                            (dict(tools=[look]), dict(async_generation=True))],
                         ids=["tool", "environment", "tool-async"])
def test_a_run_whose_tool_or_environment_shows_pictures_trains(tmp_path, monkeypatch, handed, changes):
    model, processor = BUILDERS["idefics3"]()
    monkeypatch.setattr(HFEngine, "generate", calls_look_first(processor.tokenizer))
    trainer = GRPOTrainer(model=model, reward_funcs=[shown_to_rewards], train_dataset=picture_rows(4),
                          processing_class=processor, quiet=True, **handed,
                          args=run_args(tmp_path, num_generations=2, max_completion_length=120, max_prompt_length=1024,
                                        max_steps=2, gradient_accumulation_steps=1, **changes))
    trainer.train()
    assert trainer.global_step == 2
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert records and all(f"[look] [{image_label(image(9))}] the scene" in r["completion"] for r in records)


def test_a_tool_s_picture_is_opened_from_a_file_and_what_cannot_be_opened_stops_the_run(tmp_path):
    from covey.agents.tools import as_tool, call_tool
    from covey.errors import DataError

    image(9).save(tmp_path / "scene.png")

    def from_file() -> list:
        """Look at the scene."""
        return [{"type": "image", "image": str(tmp_path / "scene.png")}, {"type": "text", "text": "the scene"}]

    def from_the_web() -> list:
        """Look at the scene."""
        return [{"type": "image_url", "image_url": {"url": "https://example.com/scene.png"}}]

    def missing() -> list:
        """Look at the scene."""
        return [{"type": "image", "path": str(tmp_path / "none.png")}]

    result = call_tool(as_tool(from_file), {}, 5.0)
    assert not result.failed and image_label(result.parts[0]["image"]) == image_label(image(9))
    assert result.text == f"[{image_label(image(9))}] the scene"
    with pytest.raises(ConfigError, match="the tool from_the_web's result: an image_url part .*give the picture itself"):
        call_tool(as_tool(from_the_web), {}, 5.0)
    with pytest.raises(DataError, match="the tool missing's result: image file .*none.png' does not exist"):
        call_tool(as_tool(missing), {}, 5.0)


def test_a_picture_a_tool_shows_a_text_model_is_refused_saying_so(tmp_path, tokenizer):
    from tests.test_agents import trainer_with

    looks = ScriptedAgent(tokenizer, call='<tool_call>{{"name": "look", "arguments": {{}}}}</tool_call>')
    trainer = trainer_with(tmp_path, tokenizer, engine=looks, tools=[look])
    with pytest.raises(ConfigError, match=r"the tool look returned a picture \(an image part among its content parts\), "
                                          "and the model reads text only: train a vision-language model"):
        scored_batch(trainer, [0, 1])
