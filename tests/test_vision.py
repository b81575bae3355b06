"""Vision-language models, trained as TRL trains them: pictures in rows (an image / images column, image parts
in chats), prompts encoded by the model's processor, the same pixel inputs for sampling and every log-prob
pass, LoRA on the language model with the vision tower frozen, and a TRL script run with only its import
changed. On six families built tiny from configs (tests/tiny_vision.py): Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Idefics3
(SmolVLM's), LLaVA and Gemma 3."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.data import load_rows
from covey.data.text import encode_prompts
from covey.errors import ConfigError, DataError, ModelError
from covey.rollout import HFEngine, SamplingParams
from covey.train.forward import SequenceBatch, TrainingForward, completion_logprobs
from covey.vision import batch_images, image_label, images_of, model_inputs, placeholder_token_ids, text_tokenizer
from covey.vision.fit import image_token_id
from covey.vision.models import vision_parts
from tests.conftest import SMALL_RUN, scored_batch
from tests.tiny_vision import BUILDERS, FAMILIES, image, saved


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def picture_rows(n: int = 4) -> list[dict]:
    return [{"prompt": chat(f"What is in picture {i}?"), "image": image(i)} for i in range(n)]


def length_reward(completions, image, **kwargs):
    """Longer completions, and some characters, score higher: completions cut at the same length still differ."""
    assert all(image_label(picture).startswith("image:") for picture in image)  # the column reaches rewards
    return [(len(text) + sum(map(ord, text)) % 5) / 8 for text in (c[0]["content"] for c in completions)]


def vision_args(tmp_path, **changes) -> GRPOConfig:
    values = dict(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=4, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, max_completion_length=6, learning_rate=1e-2, eval_max_samples=0,
                  logging_steps=1)
    values = {**SMALL_RUN, **values}  # what the run relies on beyond its sizes
    return GRPOConfig(**{**values, **changes})


# ---- rows ------------------------------------------------------------------------------------------


def test_pictures_fill_the_image_parts_of_prompts_in_trl_s_conventions(tmp_path):
    a, b = image(1), image(2)
    # an image column, a chat without placeholders: the picture goes before the first user text
    row = load_rows([{"prompt": [{"role": "system", "content": "Be brief."}, *chat("What is it?")], "image": a}])[0]
    assert row["prompt"][1]["content"] == [{"type": "image", "image": a}, {"type": "text", "text": "What is it?"}]
    assert row["image"] is a  # the column stays, for the rewards
    # an images column filling placeholders in order
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    filled = load_rows([{"prompt": prompt, "images": [a, b]}])[0]["prompt"][0]["content"]
    assert [part.get("image") for part in filled] == [a, None, b]
    # a JSON Lines file whose parts and columns name files beside it
    a.save(tmp_path / "a.png")
    b.save(tmp_path / "b.png")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": chat("Which?"), "images": ["a.png", "b.png"]}) + "\n" +
                    json.dumps({"prompt": [{"role": "user", "content": [{"type": "image", "image": "b.png"},
                                                                        {"type": "text", "text": "This?"}]}],
                                "images": []}) + "\n")
    first, second = load_rows(str(data))
    pictures = [part["image"] for part in first["prompt"][0]["content"] if part["type"] == "image"]
    assert [image_label(p) for p in pictures] == [image_label(a), image_label(b)]
    assert image_label(second["prompt"][0]["content"][0]["image"]) == image_label(b)


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "Describe it.", "image": image()}], "the prompt is plain text"),
    ([{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "x"}]}],
       "images": [image()]}], "2 empty image part(s)"),
    ([{"prompt": chat("x"), "image": image(), "images": [image()]}], "both an 'image' and an 'images' column"),
    ([{"prompt": chat("x"), "image": "missing.png"}], "image file 'missing.png' does not exist"),
    ([{"prompt": chat("x"), "image": "https://example.com/cat.png"}], "is a URL"),
])
def test_pictures_that_cannot_be_shown_are_refused_saying_where(rows, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_rows(rows)


# ---- encoding, sampling and the log-prob passes, per family -----------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model, processor = BUILDERS[request.param]()
    return request.param, model, processor


def encoded(processor, rows):
    tokenizer = text_tokenizer(processor)
    return tokenizer, encode_prompts(tokenizer, [r["prompt"] for r in load_rows(rows)], 512, processor=processor)


def test_the_processor_expands_each_picture_to_its_image_tokens(family):
    name, model, processor = family
    tokenizer, ids = encoded(processor, picture_rows(2))
    pixel = images_of(ids[0])
    assert pixel is not None and pixel.count == 1 and "pixel_values" in pixel.tensors
    # the image tokens the model sees are those the processor writes for the picture, one per feature
    text = processor.apply_chat_template(load_rows(picture_rows(1))[0]["prompt"], add_generation_prompt=True,
                                         tokenize=False)
    want = processor(text=[text], images=[[image(0)]], add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    assert ids[0] == want.tolist()
    token = image_token_id(model.config)
    with torch.no_grad():
        features = model.get_image_features(**{k: v for k, v in pixel.tensors.items()})
    features = features.pooler_output if hasattr(features, "pooler_output") else features
    count = sum(f.shape[0] for f in features) if isinstance(features, (list, tuple)) else \
        features.reshape(-1, model.config.get_text_config().hidden_size).shape[0]
    assert ids[0].count(token) == count > 0
    with pytest.raises(DataError, match="processing class is a tokenizer"):
        encode_prompts(tokenizer, [load_rows(picture_rows(1))[0]["prompt"]], 512)  # the tokenizer alone
    assert not hasattr(tokenizer, "covey_processor")  # the processor is carried beside it, not set on it


def plain_logprobs(model, sequences: SequenceBatch, suppressed: list[int] = ()) -> torch.Tensor:
    """Each completion token's log-prob under the model's own forward on the whole rows with their pictures
    (``suppressed``: tokens given no probability, as sampling gives them), 0 on padding."""
    P = sequences.prompt_ids_BP.shape[1]
    ids = torch.cat([sequences.prompt_ids_BP, sequences.completion_ids_BT], 1)
    mask = torch.cat([sequences.prompt_mask_BP, sequences.completion_mask_BT], 1)
    inputs = model_inputs(sequences.images, sequences.prompt_mask_BP, sequences.completion_ids_BT.shape[1])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **inputs).logits[:, P - 1:-1].float()
    logits[..., list(suppressed)] = float("-inf")
    logp = torch.log_softmax(logits, -1).gather(-1, sequences.completion_ids_BT.unsqueeze(-1)).squeeze(-1)
    return logp * sequences.completion_mask_BT


def test_sampling_and_the_log_prob_pass_see_the_same_pictures(family):
    name, model, processor = family
    tokenizer, ids = encoded(processor, picture_rows(3))
    engine = HFEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    params = SamplingParams(max_new_tokens=6, suppress=tuple(placeholder_token_ids(model.config)))
    rollout = engine.generate(ids, 2, params, seed=0)
    repeated = [p for p in ids for _ in range(2)]
    from covey.rollout import left_pad

    prompt_BP, mask_BP = left_pad(repeated, tokenizer.pad_token_id)
    sequences = SequenceBatch(prompt_BP, mask_BP, rollout.completion_ids_BT, rollout.completion_mask_BT,
                              batch_images(repeated))
    mask = rollout.completion_mask_BT.bool()
    with torch.no_grad():
        logp, _ = completion_logprobs(model, sequences)
    # the log-prob pass is the model's own forward with the pictures
    assert float((logp - plain_logprobs(model, sequences)).abs()[mask].max()) < 1e-5
    # sampling drew from it, less the image tokens, which the distribution the trainer computes says too
    gap = (rollout.sampling_logp_BT - plain_logprobs(model, sequences, params.suppress)).abs()[mask].max()
    assert float(gap) < 1e-4
    with torch.no_grad():
        trainer_logp, _ = completion_logprobs(model, sequences, params.distribution)
    assert float((rollout.sampling_logp_BT - trainer_logp).abs()[mask].max()) < 1e-4
    assert not set(rollout.completion_ids_BT[mask].tolist()) & set(params.suppress)
    # other pixels under the same ids give other log-probs: the pictures are what was seen
    blank = [p.images.__class__({k: v + 1.0 if v.is_floating_point() else v
                                 for k, v in p.images.tensors.items()}, p.images.token_fields, (), ()) for p in ids]
    other = SequenceBatch(prompt_BP, mask_BP, rollout.completion_ids_BT, rollout.completion_mask_BT,
                          tuple(b for b in blank for _ in range(2)))
    with torch.no_grad():
        assert float((completion_logprobs(model, other)[0] - logp).abs()[mask].max()) > 1e-3


def test_the_ratio_is_exactly_one_on_the_first_iteration(tmp_path, family):
    name, model, processor = family
    args = vision_args(tmp_path, num_iterations=2, beta=0.04)
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=picture_rows(), args=args,
                          processing_class=processor, quiet=True)
    batch, fixed = scored_batch(trainer, [0, 1])
    sequences = batch.samples.sequences
    assert sequences.images is not None and len(sequences.images) == batch.samples.size == 8
    assert fixed.old_BT is not None  # num_iterations 2: the old policy's log-probs have a pass of their own
    trainer.model.train()
    logp, _ = TrainingForward(trainer.model)(sequences, trainer.parts.sampler.sampling.distribution)
    mask = batch.samples.loss_mask_BT.bool()
    ratio = torch.exp(logp.detach() - fixed.old_BT)[mask]
    assert torch.equal(ratio, torch.ones_like(ratio))
    assert logp.requires_grad  # the training pass, with gradients
    # rows taken apart and put together again keep each row's pictures
    half = sequences.rows(slice(4, 8))
    assert half.images == sequences.images[4:8]
    assert batch.samples.select([5, 1]).sequences.images == (sequences.images[5], sequences.images[1])


def test_a_short_lora_run_trains_the_language_model_only(tmp_path, family):
    name, model, processor = family
    args = vision_args(tmp_path, use_peft=True, lora_r=4, lora_target_modules=["all-linear"], beta=0.04,
                       gradient_accumulation_steps=1, max_steps=2)
    parts = tuple(f"{part}." for part in vision_parts(model))
    tower = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(parts)}
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=picture_rows(), args=args,
                          processing_class=processor, quiet=True)
    vision = tuple(f"base_model.model.{part}" for part in parts)
    trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and not any(n.startswith(vision) for n in trained)  # no adapter on the vision tower
    assert not any(n.startswith(vision) and "lora" in n for n, _ in trainer.model.named_parameters())
    trainer.train()
    moved = [n for n, p in trainer.model.named_parameters() if n in trained and not torch.equal(p, trained[n])]
    assert any("lora_B" in n for n in moved)
    after = {n.removeprefix("base_model.model."): p
             for n, p in trainer.model.named_parameters() if n.startswith(vision)}
    assert after.keys() == tower.keys() and all(torch.equal(after[n], tower[n]) for n in tower)  # the tower as it was
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    shown = {part["image"] for r in records for part in r["prompt"][0]["content"] if part["type"] == "image"}
    assert shown <= {image_label(image(i)) for i in range(4)} and shown  # which picture each completion answered
    from covey.data.text import prompt_text

    assert prompt_text(records[0]["prompt"]).startswith("[image:")  # as the tables and the report show it


def test_full_fine_tuning_freezes_the_vision_tower_unless_asked(tmp_path):
    model, processor = BUILDERS["idefics3"]()
    parts = tuple(f"{part}." for part in vision_parts(model))
    assert parts == ("model.vision_model.", "model.connector.")
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=picture_rows(),
                          args=vision_args(tmp_path, max_steps=1), processing_class=processor, quiet=True)
    assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if n.startswith(parts))
    model, processor = BUILDERS["idefics3"]()
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=picture_rows(),
                          args=vision_args(tmp_path / "b", max_steps=1, train_vision_tower=True),
                          processing_class=processor, quiet=True)
    assert all(p.requires_grad for n, p in trainer.model.named_parameters() if n.startswith(parts))


@pytest.mark.parametrize("changes, handed, message", [
    (dict(rollout_engine="fast"), {}, "rollout_engine: fast samples from token ids only"),
    ({}, dict(rollout_func=lambda prompts, trainer: {}), "leave rollout_func out"),
])
def test_what_cannot_take_pictures_is_refused_before_anything_loads(tmp_path, changes, handed, message):
    model, processor = BUILDERS["idefics3"]()
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=picture_rows(), processing_class=processor,
                    args=vision_args(tmp_path, **changes), quiet=True, **handed)
    with pytest.raises(ConfigError, match="and this model has none"):
        from tests.conftest import make_model, make_tokenizer

        GRPOTrainer(model=make_model(100), reward_funcs=length_reward, train_dataset=[{"prompt": "x"}] * 4,
                    processing_class=make_tokenizer(), args=vision_args(tmp_path, train_vision_tower=True), quiet=True)


def test_whether_rows_show_pictures_is_read_from_every_row_not_a_sample(tmp_path):
    from datasets import Dataset

    from covey.vision import has_images

    image(0).save(tmp_path / "late.png")
    text = [{"role": "user", "content": [{"type": "text", "text": "x", "path": None}]}]
    late = [{"role": "user", "content": [{"type": "image", "text": None, "path": str(tmp_path / "late.png")},
                                         {"type": "text", "text": "x", "path": None}]}]
    rows = [{"prompt": text}] * 12 + [{"prompt": late}]  # the first picture in row 12
    assert has_images(rows) and not has_images(rows[:12])
    assert has_images([{"prompt": chat("x"), "image": None}] * 9 + [{"prompt": chat("x"), "image": image(1)}])
    model, processor = BUILDERS["idefics3"]()
    with pytest.raises(ConfigError, match="rollout_engine: fast samples from token ids only"):
        GRPOTrainer(model=model, reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
                    train_dataset=Dataset.from_list(rows[:12] + rows[-4:]),
                    processing_class=processor, args=vision_args(tmp_path, rollout_engine="fast"), quiet=True)


def test_covey_server_s_fast_engine_refuses_prompts_with_pictures_before_training(tmp_path):
    from covey.rollout.server import FastBackend, RolloutServer
    from tests.conftest import make_model, make_tokenizer

    tokenizer = make_tokenizer()
    server = RolloutServer(FastBackend(make_model(len(tokenizer)).eval(), tokenizer, [tokenizer.eos_token_id]),
                           "127.0.0.1", 0).start()
    try:
        model, processor = BUILDERS["idefics3"]()
        args = vision_args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_port=server.server_address[1],
                           vllm_server_timeout=5)
        with pytest.raises(ConfigError, match="pictures, and the server at .* is covey server, whose fast engine "
                                              "reads token ids only: start the server with --backend vllm"):
            GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=picture_rows(),
                        processing_class=processor, args=args, quiet=True)
        # prompts of text alone: the model's image tokens must still never be sampled, which the fast engine
        # cannot promise
        with pytest.raises(ConfigError, match="the policy is a vision-language model, whose image tokens are never "
                                              "sampled, and the server at .* is covey server"):
            GRPOTrainer(model=model, reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
                        train_dataset=[{"prompt": chat("x")}] * 4, processing_class=processor, args=args, quiet=True)
        from covey.rollout import ServerEngine
        from covey.rollout.wire import GENERATE

        engine = ServerEngine("127.0.0.1", server.server_address[1], 0, [3], timeout=5)
        assert not engine.takes_images
        with pytest.raises(ConfigError, match="HTTP 400: covey server's fast engine reads token ids only"):
            engine.api.post(GENERATE, {"token_ids": [1, 2]})  # and the server itself says so
    finally:
        server.close()


def test_a_prompt_with_pictures_travels_to_the_server_as_the_template_s_ids_and_lossless_pictures():
    import base64
    import io

    from PIL import Image

    from covey.rollout.wire import generate_request, generated_choices, picture_url, rollout_from_choices

    model, processor = BUILDERS["idefics3"]()
    tokenizer, ids = encoded(processor, picture_rows(1))
    pictures = images_of(ids[0])
    urls = [picture_url(p) for p in pictures.pictures]
    params = SamplingParams(max_new_tokens=5, temperature=0.7, suppress=(7, 9))
    body = generate_request("m", pictures.unexpanded(list(ids[0])), urls, 2, params, [3], 11)
    assert body["token_ids"] == list(pictures.expansions[0].template_ids) and len(body["token_ids"]) < len(ids[0])
    [part] = body["content_parts"]
    assert part["type"] == "image_url" and part["url"].startswith("data:image/png;base64,")
    decoded = Image.open(io.BytesIO(base64.b64decode(part["url"].split(",", 1)[1])))
    assert decoded.tobytes() == image(0).tobytes() and decoded.size == image(0).size  # the very pixels
    sampling = body["sampling_params"]
    assert (sampling["n"], sampling["seed"], sampling["logprobs"], sampling["temperature"]) == (2, 11, 0, 0.7)
    assert sampling["logit_bias"] == {"7": -100.0, "9": -100.0} and sampling["stop_token_ids"] == [3]
    content = [{"token_id": 5, "logprob": -0.5}, {"token_id": 3, "logprob": -1.25}]
    reply = {"choices": [{"index": i, "token_ids": [5, 3], "finish_reason": "stop", "stop_reason": None,
                          "logprobs": {"content": content}} for i in range(2)]}
    rollout = rollout_from_choices([generated_choices(reply)], 2, 0)
    assert rollout.completion_ids_BT.tolist() == [[5, 3]] * 2 and rollout.finish_reasons == ["eos"] * 2
    assert rollout.sampling_logp_BT.tolist() == [[-0.5, -1.25]] * 2
    # a vLLM server started without --enable-scale-out answers that endpoint 403: what to do is said
    import urllib.error

    from covey.rollout.client import _http_error
    from covey.rollout.wire import GENERATE

    refusal = b'{"error": {"message": "Scale-out endpoints are disabled."}}'
    error = _http_error("http://h:1", GENERATE, urllib.error.HTTPError("u", 403, "Forbidden", {}, io.BytesIO(refusal)))
    assert isinstance(error, ConfigError) and "start vLLM's server with --enable-scale-out" in str(error)


def test_a_prompt_s_pictures_are_encoded_once_per_run_through_a_server(monkeypatch):
    from types import SimpleNamespace

    from covey.rollout import wire
    from covey.rollout.client import ServerEngine
    from covey.vision import with_images_of

    model, processor = BUILDERS["idefics3"]()
    tokenizer, ids = encoded(processor, picture_rows(2))
    encodings = []
    png = wire.picture_url
    monkeypatch.setattr(wire, "picture_url", lambda picture: encodings.append(picture) or png(picture))
    engine = ServerEngine.__new__(ServerEngine)  # its own bookkeeping, without a server to reach
    engine.info, engine.url = SimpleNamespace(covey_server=False), "http://h:1"
    engine.encoded_pictures = wire.PictureURLs()
    rounds = [engine._picture_urls([p for p in ids for _ in range(2)]) for _ in range(3)]  # three rounds of G = 2
    later = engine._picture_urls([with_images_of(ids[0], list(ids[0]) + [40, 41])])  # an episode's later turn
    assert len(encodings) == 2  # one picture per prompt, each encoded once
    assert rounds[0] == rounds[2] and list(later.values()) == [rounds[0][id(images_of(ids[0]))]]
    assert rounds[0][id(images_of(ids[1]))] == [png(image(1))]


# ---- a TRL script -------------------------------------------------------------------------------------

SCRIPT = '''
from datasets import Dataset
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import GRPOConfig, GRPOTrainer
import numpy as np
from PIL import Image

MODEL = {model!r}


def reward_len(completions, **kwargs):
    return [-abs(5 - len(completion[0]["content"])) for completion in completions]


if __name__ == "__main__":
    pictures = [Image.fromarray((np.random.RandomState(i).rand(40, 48, 3) * 255).astype("uint8")) for i in range(4)]
    dataset = Dataset.from_list([{{"prompt": [{{"role": "user", "content": [{{"type": "image"}},
                                                                            {{"type": "text", "text": "What is it?"}}]}}],
                                   "image": picture}} for picture in pictures])
    model = AutoModelForImageTextToText.from_pretrained(MODEL)
    processor = AutoProcessor.from_pretrained(MODEL)
    training_args = GRPOConfig(output_dir={output!r}, per_device_train_batch_size=4, num_generations=4,
                               max_completion_length=6, learning_rate=1e-3, logging_steps=1, max_steps=2,
                               report_to="none", seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=training_args, train_dataset=dataset,
                          processing_class=processor)
    trainer.train()
'''


def test_a_trl_vision_script_runs_with_only_its_import_changed(tmp_path):
    folder = saved("idefics3", tmp_path / "tiny-smolvlm")
    text = SCRIPT.format(model=folder, output=str(tmp_path / "run"))
    script = tmp_path / "train_vlm_grpo.py"
    script.write_text(text.replace("from trl import GRPOConfig, GRPOTrainer", "from covey import GRPOConfig, GRPOTrainer"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


# ---- covey verify ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_verify_checks_the_image_stage(name):
    from covey.verify import verify

    model, processor = BUILDERS[name]()
    args = GRPOConfig(num_generations=4, per_device_train_batch_size=4, max_completion_length=6, max_steps=1,
                      learning_rate=1e-3, logging_steps=1)
    report = verify(args, model=model, processing_class=processor, train_dataset=picture_rows(), reward_funcs=[
        lambda completions, **kwargs: [len(c[0]["content"]) / 8 for c in completions]])
    stage = {c.name: c for c in report.checks if c.stage == "images"}
    assert set(stage) == {"prompts are the processor's", "image tokens match the vision tower's features",
                          "log-probs equal a plain forward with the pictures", "the pictures change the log-probs"}
    assert report.first_failure is None, [c for c in report.checks if c.status == "FAIL"]
    import re

    counts = re.findall(r"(\d+) tokens / (\d+) features", stage["image tokens match the vision tower's features"].value)
    assert len(counts) == 2 and all(tokens == features != "0" for tokens, features in counts)


# each family's model with a processor of another family: the tower cannot read its pixel inputs, or the image
# tokens and the tower's features disagree in number
MISMATCHED = {"qwen2_vl": "qwen3_vl", "qwen2_5_vl": "idefics3", "qwen3_vl": "qwen2_vl", "idefics3": "llava",
              "llava": "gemma3", "gemma3": "llava"}


@pytest.mark.parametrize("name", FAMILIES)
def test_a_processor_of_another_family_is_named_before_anything_samples(tmp_path, name):
    model, _ = BUILDERS[name]()
    _, processor = BUILDERS[MISMATCHED[name]]()
    with pytest.raises(ModelError, match=f"the processor {type(processor).__name__} does not belong to the model "
                                         f"{type(model).__name__}: .*give the model's own processor"):
        GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=picture_rows(), processing_class=processor,
                    args=vision_args(tmp_path), quiet=True)


def test_qwen2_vl_s_and_qwen2_5_vl_s_processors_fit_each_other_s_model(tmp_path):
    for name, other in (("qwen2_vl", "qwen2_5_vl"), ("qwen2_5_vl", "qwen2_vl")):  # the same inputs, written alike
        model, _ = BUILDERS[name]()
        _, processor = BUILDERS[other]()
        trainer = GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=picture_rows(),
                              processing_class=processor, args=vision_args(tmp_path / name), quiet=True)
        assert trainer.processing_class is processor  # taken, not refused


def test_verify_names_a_processor_of_another_size_of_the_model(tmp_path):
    from covey.verify import verify

    model, processor = BUILDERS["idefics3"]()
    processor.image_seq_len = 2  # two image tokens per picture, for a tower that gives one feature
    args = GRPOConfig(num_generations=4, per_device_train_batch_size=4, max_completion_length=6, max_steps=1)
    report = verify(args, model=model, processing_class=processor, train_dataset=picture_rows(), reward_funcs=[
        lambda completions, **kwargs: [1.0] * len(completions)])
    failed = [c for c in report.checks if c.status == "FAIL"]
    assert report.first_failure == "setup" and "holds 2 of the model's image tokens" in failed[0].hint, failed
    assert "give the model's own processor" in failed[0].hint


# ---- several turns, and a run described by its config alone ------------------------------------------------


def test_a_later_turn_of_an_episode_still_sees_the_prompt_s_pictures():
    from covey.rollout import left_pad
    from covey.rollout.engine import episodes_by_turns

    model, processor = BUILDERS["idefics3"]()
    tokenizer, ids = encoded(processor, picture_rows(2))
    engine = HFEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    params = SamplingParams(max_new_tokens=12, suppress=tuple(placeholder_token_ids(model.config)))
    note = tokenizer("<s>tool\nok</s>\n<s>assistant\n", add_special_tokens=False)["input_ids"]
    answered = set()

    def respond(row, turn_ids, room):  # one tool message after each episode's first turn
        if row in answered:
            return None
        answered.add(row)
        return note[:room - 1]

    # short turns: the model's end token made likely, so that a first turn ends before the budget
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 8.0
    rollout = episodes_by_turns(engine, ids, 2, params, 0, respond, tokenizer.pad_token_id)
    repeated = [p for p in ids for _ in range(2)]
    prompt_BP, mask_BP = left_pad(repeated, tokenizer.pad_token_id)
    sequences = SequenceBatch(prompt_BP, mask_BP, rollout.completion_ids_BT, rollout.completion_mask_BT,
                              batch_images(repeated))
    with torch.no_grad():
        logp, _ = completion_logprobs(model, sequences, params.distribution)
    sampled = rollout.sampled_mask_BT.bool()
    later = sampled & (rollout.sampled_mask_BT.cumsum(1) < torch.arange(1, sampled.shape[1] + 1))  # after a tool message
    assert later.any(), "no episode had a second turn"
    assert float((logp - rollout.sampling_logp_BT).abs()[sampled].max()) < 1e-4


def test_a_run_described_by_its_config_alone_trains_on_pictures_named_in_a_data_file(tmp_path):
    folder = saved("idefics3", tmp_path / "tiny-smolvlm")
    for i in range(2):
        image(i).save(tmp_path / f"p{i}.png")
    data = tmp_path / "pictures.jsonl"
    data.write_text("".join(json.dumps({"prompt": chat(f"What is in picture {i % 2}?"), "image": f"p{i % 2}.png"}) + "\n"
                            for i in range(4)))
    args = GRPOConfig.from_dict(dict(model=folder, dataset=str(data), reward_funcs=["json_format"],
                                     output_dir=str(tmp_path / "run"), max_steps=1, num_generations=4,
                                     per_device_train_batch_size=4, max_completion_length=4, eval_max_samples=0))
    trainer = GRPOTrainer(args=args, quiet=True)
    assert type(trainer.model).__name__ == "Idefics3ForConditionalGeneration"
    assert trainer.args.rollout_engine == "hf"  # no engine asked for: transformers' generate takes the pictures
    # the processor loaded with the model is carried beside its tokenizer, and is TRL's processing_class
    assert type(trainer.processing_class).__name__ == "Idefics3Processor"
    assert trainer.tokenizer is trainer.processing_class.tokenizer and not hasattr(trainer.tokenizer, "covey_processor")
    trainer.train()
    saved_model = tmp_path / "run" / "final_model"
    from transformers import AutoProcessor

    assert type(AutoProcessor.from_pretrained(saved_model)).__name__ == "Idefics3Processor"


def test_vllm_is_given_each_picture_s_placeholder_as_the_chat_template_wrote_it():
    from covey.rollout.vllm_engine import vllm_prompt
    from covey.vision import with_images_of

    model, processor = BUILDERS["idefics3"]()
    tokenizer, ids = encoded(processor, picture_rows(1))
    text = processor.apply_chat_template(load_rows(picture_rows(1))[0]["prompt"], add_generation_prompt=True,
                                         tokenize=False)
    written = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = vllm_prompt(ids[0])
    assert prompt["prompt_token_ids"] == written and len(written) < len(ids[0])  # the processor expanded it
    assert [image_label(p) for p in prompt["multi_modal_data"]["image"]] == [image_label(image(0))]
    later = vllm_prompt(with_images_of(ids[0], list(ids[0]) + [40, 41]))  # an episode's later turn
    assert later["prompt_token_ids"] == written + [40, 41]
    assert vllm_prompt([5, 6]) == {"prompt_token_ids": [5, 6]}
