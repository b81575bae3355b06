"""covey plan reads the prompts where it can before a model loads: their measured lengths in the estimate,
and the plan says which lengths it took and from where.

The model here has a character-level tokenizer (conftest.make_tokenizer): a plain prompt is one token a
character, and a chat prompt of one user message ``c`` is "<s>user\\nc</s>\\n<s>assistant\\n", 19 + len(c)
tokens (<s> and </s> one token each), so the expected lengths are counted by hand.
"""

from __future__ import annotations

import json
import statistics

import pytest

from covey.config import GRPOConfig
from covey.plan import Device, check_fits, make_plan
from covey.plan.check import least_the_user_asked_for
from covey.plan.prompts import hub_cached_files, measure_prompts
from covey.plan.report import plan_text

DEVICE = Device("a test device", "cpu", 64 * 2 ** 30, 64 * 2 ** 30)
SIZES = dict(max_steps=2, max_completion_length=16, per_device_train_batch_size=4, num_generations=2,
             learning_rate=1e-6, logging_steps=1, reward_funcs=["answer_format"], max_prompt_length=96)


@pytest.fixture
def model_folder(tmp_path):
    """A model's config.json and tokenizer, no weights (the plan reads nothing else)."""
    from transformers import LlamaConfig

    from tests.conftest import make_tokenizer

    folder = tmp_path / "model"
    LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def write_jsonl(path, prompts) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return str(path)


def test_the_plan_takes_the_longest_prompt_of_a_local_file(model_folder, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("weights loaded")))
    data = write_jsonl(tmp_path / "rows.jsonl", [chat("a" * 5), chat("b" * 30), chat("c" * 11)])
    args = GRPOConfig(**SIZES, model=str(model_folder), dataset=data)
    plan = make_plan(args, 1, DEVICE)
    assert (plan.prompts.longest, plan.prompts.median) == (19 + 30, 19 + 11)
    assert plan.settings.prompt_length == 49
    assert f"prompts measured from {data}: longest 49, median 30 tokens" in plan_text(plan)
    assert "micro-batch 4 x (49 prompt + 16 completion tokens)" in plan_text(plan)
    # the run's system prompt is rendered in, as the trainer renders it: "<s>system\nBe brief.</s>\n" is 19 tokens
    with_system = make_plan(GRPOConfig(**SIZES, model=str(model_folder), dataset=data, system_prompt="Be brief."), 1,
                            DEVICE)
    assert with_system.prompts.longest == 49 + 19
    # the memory check before loading takes the same lengths, max_prompt_length left at covey's default or not
    for sizes in (SIZES, {k: v for k, v in SIZES.items() if k != "max_prompt_length"}):
        checked = check_fits(GRPOConfig(**sizes, model=str(model_folder), dataset=data), 1)
        assert least_the_user_asked_for(checked).settings.prompt_length == 49


def test_prompts_over_max_prompt_length_are_taken_at_it_and_a_large_file_is_sampled(model_folder, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ["x" * n for n in (4, 8, 120, 16, 200, 2, 6, 10, 12, 14)])
    args = GRPOConfig(**SIZES, model=str(model_folder), dataset=data)
    every = measure_prompts(args)  # plain prompts: a token a character
    assert (every.longest, every.median, every.over, every.rows) == (96, 11, 2, 10)
    assert every.describe() == (f"prompts measured from {data}: longest 96, median 11 tokens, 2 over "
                                "max_prompt_length 96 taken at it")
    sampled = measure_prompts(args, sample=4)
    assert (sampled.rows, sampled.of_rows) == (4, 10)
    assert f"prompts measured from {data}, 4 of 10 rows sampled: longest" in sampled.describe()


def test_rows_handed_to_the_trainer_are_measured(model_folder):
    import datasets

    rows = [{"prompt": chat("d" * n), "answer": "1"} for n in (3, 7)]
    for handed in (rows, datasets.Dataset.from_list(rows)):
        plan = check_fits(GRPOConfig(**SIZES, model=str(model_folder)), 1, handed)
        assert plan.prompts.source == "train_dataset" and plan.prompts.longest == 19 + 7


def _cache_a_hub_dataset(cache, name: str) -> None:
    """A hub dataset as the hub cache keeps it: refs/main names the snapshot, a folder per configuration."""
    folder = cache / f"datasets--{name.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("abc123")
    snapshot = folder / "snapshots" / "abc123"
    for config, split, length in (("main", "train", 40), ("main", "test", 70), ("other", "train", 90)):
        (snapshot / config).mkdir(parents=True, exist_ok=True)
        write_jsonl(snapshot / config / f"{split}-00000-of-00001.jsonl", [chat("e" * length), chat("f" * 3)])


def test_a_hub_dataset_is_read_from_the_cache_and_one_not_there_is_assumed_at_the_limit(model_folder, tmp_path,
                                                                                          monkeypatch):
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _cache_a_hub_dataset(tmp_path / "hub", "someone/numbers")
    args = GRPOConfig(**SIZES, model=str(model_folder), dataset="someone/numbers", dataset_config="main")
    assert [p.name for p in hub_cached_files("someone/numbers", "main", "train")] == ["train-00000-of-00001.jsonl"]
    plan = make_plan(args, 1, DEVICE)
    assert plan.prompts.longest == 19 + 40 and plan.prompts.source == "someone/numbers"

    loaded = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: loaded.append(a) or pytest.fail("read the hub"))
    missing = make_plan(GRPOConfig(**SIZES, model=str(model_folder), dataset="nobody/nothing"), 1, DEVICE)
    assert not missing.prompts.measured and not loaded
    assert missing.settings.prompt_length == 96
    assert ("prompts: assumed max_prompt_length 96: the data could not be read before loading (dataset "
            "'nobody/nothing' is not in the Hugging Face hub cache, and the plan downloads nothing)") in plan_text(missing)
    # the check then takes covey's default limit at its least, as before
    assert least_the_user_asked_for(missing).settings.prompt_length == 96
    default_limit = make_plan(GRPOConfig(**{**SIZES, "max_prompt_length": 512}, model=str(model_folder),
                                         dataset="nobody/nothing"), 1, DEVICE)
    assert default_limit.settings.prompt_length == 512
    assert least_the_user_asked_for(default_limit).settings.prompt_length == 512  # given: kept


def test_prompts_that_show_tools_are_assumed_at_the_limit(model_folder, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", [chat("g")])
    lengths = measure_prompts(GRPOConfig(**SIZES, model=str(model_folder), dataset=data, tools=["calculate"]))
    assert not lengths.measured and lengths.peak_length == 96 and "tools" in lengths.describe()


def test_the_embedded_model_s_prompts_are_measured_without_its_weights(monkeypatch):
    """The default run's prompts, through the embedded model's own tokenizer and chat template."""
    from transformers import AutoTokenizer, PreTrainedModel

    from covey.data import load_rows
    from covey.plan.shapes import embedded_source

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("weights loaded")))
    args = GRPOConfig(**{**SIZES, "max_prompt_length": 512}, dataset="arithmetic")
    lengths = measure_prompts(args)
    folder, gguf_file = embedded_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf_file} if gguf_file else {}))
    counted = sorted(len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])
                     for row in load_rows("arithmetic"))
    assert lengths.source == "arithmetic" and lengths.rows == len(counted)
    assert (lengths.longest, lengths.median) == (counted[-1], round(statistics.median(counted)))


def test_the_trainer_s_check_measures_the_rows_it_was_handed(model_folder, monkeypatch):
    """A step that fits at the handed rows' lengths and not at max_prompt_length: refused only where the
    rows are not measured."""
    import covey.plan.planning
    from covey.plan import MemoryPlanError
    from covey.plan.prompts import PromptLengths
    from covey.train.run_rules import Handed, fits_the_device

    rows = [{"prompt": chat("h" * 7), "answer": "1"}]
    args = GRPOConfig(**{**SIZES, "max_prompt_length": 20000}, model=str(model_folder))
    short = make_plan(args, 1, DEVICE, prompts=measure_prompts(args, rows)).needed
    long = make_plan(args, 1, DEVICE, prompts=PromptLengths(20000)).needed
    between = int((short * long) ** 0.5)
    assert short * 1.5 < between < long / 1.5
    monkeypatch.setattr(covey.plan.planning, "this_device", lambda *a, **k: Device("d", "cpu", between, between))
    assert fits_the_device(args, Handed(train_dataset=rows), lambda ok, message: None) is None
    with pytest.raises(MemoryPlanError, match="cannot fit"):
        fits_the_device(args, Handed(), lambda ok, message: None)
