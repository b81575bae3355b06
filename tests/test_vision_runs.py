"""Prompts with pictures through the paths text runs take: asynchronous generation, resume from a checkpoint,
two processes (DDP and FSDP2); and a picture a tool or an environment returns, refused. On the cheapest family
of tests/tiny_vision.py, Idefics3 (one image token per picture)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.errors import ConfigError
from covey.rollout import HFEngine
from covey.train.sharding import whole
from covey.vision import image_label, images_of
from tests.conftest import SMALL_RUN, scored_batch
from tests.test_agents import ROWS as AGENT_ROWS, ScriptedAgent
from tests.test_checkpoint import assert_same_weights, learned_metrics
from tests.test_distributed import ScriptedEngine, as_launched, free_port, run_in_two_processes
from tests.tiny_vision import BUILDERS, image


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


class LooksAround(ScriptedAgent):
    """The agents' scripted episodes, for prompts with pictures: its first turn calls the tool look."""

    takes_images = True

    def __init__(self, tokenizer):
        super().__init__(tokenizer, call='<tool_call>{{"name": "look", "arguments": {{}}}}</tool_call>')


@pytest.mark.parametrize("handed", [dict(tools=[look]), dict(environment_factory=Scene)], ids=["tool", "environment"])
def test_a_tool_or_an_environment_that_returns_a_picture_stops_the_run_saying_so(tmp_path, handed):
    model, processor = BUILDERS["idefics3"]()
    rows = [{**row, "image": image(i)} for i, row in enumerate(AGENT_ROWS)]
    trainer = GRPOTrainer(model=model, reward_funcs=[spread], train_dataset=rows, processing_class=processor,
                          args=run_args(tmp_path, num_generations=2, max_completion_length=200, max_prompt_length=1024),
                          rollout_engine=LooksAround(processor.tokenizer), quiet=True, **handed)
    with pytest.raises(ConfigError, match=r"the tool look returned a picture \(\{'type': 'image', \.\.\.\} among its "
                                          r"content parts, .*covey does not add the pictures of a tool's or an "
                                          "environment's message to the conversation; return text"):
        scored_batch(trainer, [0, 1])

