import json
from pathlib import Path

import pytest

from covey.data import PromptSampler, heldout_rows, load_rows
from covey import GRPOConfig
from covey.errors import ConfigError, DataError
from covey.data.tasks import arithmetic, gsm8k_final_answer

DATA = Path(__file__).parent / "data"
SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def test_arithmetic_splits_are_disjoint_seeded_and_answerable():
    train, test = arithmetic("train"), arithmetic("test")
    pair = lambda row: row["prompt"][-1]["content"]  # noqa: E731
    numbers = lambda row: tuple(int(t) for t in pair(row).replace("?", " ").replace(".", " ").split() if t.isdigit())  # noqa: E731
    assert not {numbers(r) for r in train} & {numbers(r) for r in test}
    assert arithmetic("train") == train  # same every call
    for row in train[:50] + test:
        a, b = numbers(row)
        assert int(row["answer"]) == a + b
        assert row["prompt"][0]["role"] == "system" and "<answer>" in row["prompt"][0]["content"]
    assert len(test) == 64 and len(train) == 3 * (169 - 64)


def test_local_files_in_every_format(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(3)]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_rows(str(jsonl)) == rows
    import datasets

    plain = [{"prompt": f"question {i}", "answer": str(i)} for i in range(3)]
    datasets.Dataset.from_list(plain).to_csv(tmp_path / "d.csv")
    datasets.Dataset.from_list(plain).to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        loaded = load_rows(str(tmp_path / name))
        assert [r["prompt"] for r in loaded] == [r["prompt"] for r in plain]
    assert load_rows(datasets.Dataset.from_list(rows)) == rows


def test_gsm8k_format_becomes_chat_prompts_with_final_answers():
    rows = load_rows(str(DATA / "gsm8k_sample.jsonl"))
    first = json.loads((DATA / "gsm8k_sample.jsonl").read_text().splitlines()[0])
    assert rows[0]["answer"] == first["answer"].split("####")[-1].strip()
    assert rows[0]["prompt"][-1] == {"role": "user", "content": first["question"]}
    assert gsm8k_final_answer("so 3,000 total\n#### 3,000") == "3000"


@pytest.mark.skipif(not SHARED_GSM8K.is_dir(), reason="the full GSM8K copy is not beside this checkout")
def test_full_gsm8k_test_split_loads():
    rows = load_rows(str(SHARED_GSM8K / "test.jsonl"))
    assert len(rows) == 1319 and all(r["answer"].lstrip("-").replace(".", "").isdigit() for r in rows)


@pytest.mark.parametrize("rows, message", [
    ([], "empty"),
    ([{"text": "hi"}], "no 'prompt' column"),
    ([{"prompt": "ok"}, {"prompt": "  "}], "row 1: 'prompt' must be a non-empty"),
    ([{"prompt": [{"role": "user"}]}], "row 0"),
    ([{"prompt": "a", "answer": 1}, {"prompt": "b"}], "row 1: columns"),
])
def test_bad_rows_are_reported_with_the_row(rows, message):
    with pytest.raises(DataError, match=message):
        load_rows(rows)


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))


def test_heldout_rows():
    assert len(heldout_rows("arithmetic", None, 10)) == 10
    # a built-in task named as eval_dataset gives its held-out split, not its training rows
    train = {repr(r["prompt"]) for r in load_rows("arithmetic")}
    for dataset, eval_dataset in (("arithmetic", None), ("my_data.jsonl", "arithmetic")):
        rows = heldout_rows(dataset, eval_dataset, 1000)
        assert rows and not any(repr(r["prompt"]) in train for r in rows)
    assert heldout_rows([{"prompt": "x"}], "arithmetic", 1000, "train") == load_rows("arithmetic")
    assert heldout_rows("arithmetic", None, 0) is None
    assert heldout_rows([{"prompt": "x"}], None, 10) is None


def test_prompt_sampler_covers_every_row_each_pass_and_is_seeded():
    assert next(PromptSampler(10, 4, seed=3, shuffle=False)) == [0, 1, 2, 3]  # shuffle_dataset: false
    in_order = PromptSampler(3, 2, seed=3, shuffle=False)
    assert [next(in_order) for _ in range(3)] == [[0, 1], [2, 0], [1, 2]]
    sampler = PromptSampler(10, 5, seed=3)
    first_pass = next(sampler) + next(sampler)
    assert sorted(first_pass) == list(range(10))
    again = PromptSampler(10, 5, seed=3)
    assert next(again) + next(again) == first_pass


@pytest.mark.parametrize("rows, per_draw", [(10, 5), (7, 3), (8, 8), (5, 7)])
def test_the_passes_after_a_number_of_draws_are_those_the_sampler_reaches(rows, per_draw):
    """What the trainer reckons from the rounds it trained (under async_generation the sampler is ahead)."""
    sampler = PromptSampler(rows, per_draw, seed=1)
    for draws in range(12):
        # the sampler's own reckoning after those draws: a pass ends with the draw of its last row
        passes_done = sampler.epoch if sampler.epoch and not sampler.order else max(sampler.epoch - 1, 0)
        assert (sampler.passes_in(draws), sampler.progress_in(draws)) == (passes_done, sampler.progress)
        next(sampler)


def test_hub_dataset_ids_go_to_datasets_with_the_split(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return [{"prompt": "hi", "answer": "1"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_rows("someone/some-dataset", split="validation") == [{"prompt": "hi", "answer": "1"}]
    assert calls == [(("someone/some-dataset",), {"split": "validation"})]


def test_a_column_a_reward_needs_is_checked_by_name_and_row(tmp_path):
    from covey.rewards import check_reward_columns
    from covey.rewards import answer_correct

    def needs_tests(completions, tests, **kwargs):
        return [0.0] * len(completions)

    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    check_reward_columns(rows, [answer_correct], "data.jsonl")  # fine
    with pytest.raises(DataError, match="'needs_tests' needs a column 'tests'.*columns: prompt, answer"):
        check_reward_columns(rows, [needs_tests], "data.jsonl")
    # a JSONL row without the key: the loader fills it with null, and the error names the row
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    from covey.data import load_rows

    with pytest.raises(DataError, match=r"row 1: column 'answer', needed by reward function 'answer_correct', is empty"):
        check_reward_columns(load_rows(str(path)), [answer_correct], str(path))


@pytest.mark.parametrize("completion, answer", [
    ("<think>2+2 is 4</think> 4", "4"),
    ("2+2 is 4</think> 4", "4"),  # the chat template opened <think> in the prompt (R1-distill style)
    ("2+2 is 4</think>", ""),
    ("a</think> <think>b</think> 4", "4"),
    ("<think>2+2 is", ""),
    ("4", "4"),
])
def test_the_answer_after_reasoning_is_what_follows_the_last_closing_tag(completion, answer):
    from covey.data.text import answer_after_reasoning

    assert answer_after_reasoning(completion) == answer


def test_gsm8k_format_keeps_the_other_columns_for_the_rewards(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text('{"question": "1+1?", "answer": "so\\n#### 2", "difficulty": 3}\n')
    (row,) = load_rows(str(path))
    assert row["prompt"][-1]["content"] == "1+1?"
    assert {k: v for k, v in row.items() if k != "prompt"} == {"answer": "2", "solution": "so\n#### 2", "difficulty": 3}
    path.write_text('{"question": "1+1?", "answer": "so\\n#### 2", "solution": "mine"}\n')
    assert load_rows(str(path))[0]["solution"] == "mine"  # a solution of its own is kept


@pytest.mark.parametrize("column", ["completions", "prompts", "completion_ids", "trainer_state", "log_metric",
                                    "log_extra"])
def test_a_column_named_like_a_trainer_reward_argument_is_refused(tmp_path, column):
    path = tmp_path / "clash.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "answer": "4", column: "x"}) + "\n")
    with pytest.raises(DataError, match=rf"clash.jsonl: column '{column}' has the name of an argument.*rename the column"):
        load_rows(str(path))
    gsm8k = [{"question": "2+2?", "answer": "#### 4", column: "x"}]
    with pytest.raises(DataError, match=f"column '{column}'"):
        load_rows(gsm8k)


def test_file_endings_in_any_case_and_gzip_compressed(tmp_path):
    import gzip

    rows = [{"prompt": "q", "answer": "1"}]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "CHAT.JSONL").write_text(lines)
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "d.Json.GZ").write_bytes(gzip.compress(json.dumps(rows).encode()))
    (tmp_path / "d.csv.gz").write_bytes(gzip.compress(b"prompt,answer\nq,one\n"))
    for name in ("CHAT.JSONL", "d.jsonl.gz", "d.Json.GZ"):
        assert load_rows(str(tmp_path / name)) == rows
    assert load_rows(str(tmp_path / "d.csv.gz")) == [{"prompt": "q", "answer": "one"}]
    with pytest.raises(DataError, match="does not exist"):
        load_rows(str(tmp_path / "nope.CSV.gz"))


def test_chat_prompts_need_a_tokenizer_with_a_chat_template(tokenizer):
    from covey.data.text import encode_prompts

    tokenizer.chat_template = None  # a base model's tokenizer
    assert encode_prompts(tokenizer, ["1+1="], 16) == [tokenizer("1+1=", add_special_tokens=False)["input_ids"]]
    chats = ["1+1=", [{"role": "user", "content": "1+1?"}]]
    with pytest.raises(DataError, match=r"train_dataset, row 1: .*no chat template.*plain-string prompts"):
        encode_prompts(tokenizer, chats, 16, "train_dataset")


@pytest.mark.parametrize("name, text, message", [
    ("broken.jsonl", '{"prompt": "a"}\n{"prompt": "b",\n{"prompt": "c"}\n',
     r"broken.jsonl, line 2: not valid JSON \(Expecting property name enclosed in double quotes, column 16\)"),
    ("list.jsonl", '{"prompt": "a"}\n["b"]\n', r"list.jsonl, line 2: a JSON list, not an object"),
    ("empty.jsonl", "\n\n", r"dataset file .*empty.jsonl is empty"),
    ("empty.csv", "", r"dataset file .*empty.csv is empty"),
])
def test_a_malformed_or_empty_data_file_is_said_with_its_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=message):
        load_rows(str(tmp_path / name))


def test_a_broken_line_of_a_gzipped_file_is_found_too(tmp_path):
    import gzip

    with gzip.open(tmp_path / "rows.jsonl.gz", "wt") as f:
        f.write('{"prompt": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r"rows.jsonl.gz, line 2: not valid JSON"):
        load_rows(str(tmp_path / "rows.jsonl.gz"))
    (tmp_path / "list.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]))  # one JSON document
    assert [r["prompt"] for r in load_rows(str(tmp_path / "list.json"))] == ["a", "b"]


def test_system_prompt_comes_first_in_every_prompt(tmp_path):
    rows = [{"prompt": "2 + 2?"}, {"prompt": [{"role": "user", "content": "3 + 3?"}]}]
    chats = load_rows(rows, system_prompt="Answer in <answer> tags.")
    assert [r["prompt"] for r in chats] == [
        [{"role": "system", "content": "Answer in <answer> tags."}, {"role": "user", "content": "2 + 2?"}],
        [{"role": "system", "content": "Answer in <answer> tags."}, {"role": "user", "content": "3 + 3?"}]]
    held_out = heldout_rows("data.jsonl", [{"prompt": "1 + 1?"}, {"prompt": "2 + 1?"}], 2, system_prompt="Be brief.")
    assert [r["prompt"][0] for r in held_out] == [{"role": "system", "content": "Be brief."}] * 2
    with pytest.raises(DataError, match="train_dataset, row 0: the prompt has a system message already"):
        load_rows([{"prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}],
                  system_prompt="z")
    # the system message covey writes into a built-in task's and GSM8K-format rows gives way to the user's
    assert load_rows("arithmetic", system_prompt="z")[0]["prompt"][:2] == [
        {"role": "system", "content": "z"}, {"role": "user", "content": load_rows("arithmetic")[0]["prompt"][1]["content"]}]
    gsm8k = load_rows([{"question": "How many?", "answer": "2 + 2 = 4\n#### 4"}], system_prompt="Think, then answer.")
    assert gsm8k[0]["prompt"] == [{"role": "system", "content": "Think, then answer."},
                                  {"role": "user", "content": "How many?"}]


def test_trl_script_dataset_arguments_choose_the_config_and_the_held_out_split(monkeypatch):
    import covey.data.rows as rows_module

    calls = []
    monkeypatch.setattr(rows_module, "_load_with_datasets",
                        lambda *args, **kwargs: calls.append((args, kwargs)) or [{"prompt": "p", "answer": "1"}])
    config = GRPOConfig.from_dict({"dataset_name": "openai/gsm8k", "dataset_config": "main",
                                   "dataset_train_split": "train", "dataset_test_split": "test"})
    assert (config.dataset, config.eval_dataset, config.eval_split) == ("openai/gsm8k", "openai/gsm8k", "test")
    load_rows(config.dataset, config.dataset_split, config=config.dataset_config)
    heldout_rows(config.dataset, config.eval_dataset, 4, config.eval_split, dataset_config=config.dataset_config)
    heldout_rows(config.dataset, "other/data", 4, "validation", dataset_config=config.dataset_config)
    assert calls == [(("openai/gsm8k",), {"split": "train", "name": "main"}),
                     (("openai/gsm8k",), {"split": "test", "name": "main"}),
                     (("other/data",), {"split": "validation"})]  # the config is the training dataset's


def test_dataset_config_of_a_local_file_or_task_is_refused():
    with pytest.raises(DataError, match="dataset_config='main' chooses a configuration of a Hugging Face dataset, "
                                        "and 'arithmetic' is a built-in task"):
        load_rows("arithmetic", config="main")
    with pytest.raises(ConfigError, match="dataset_test_split='test' and eval_split='validation' name the same"):
        GRPOConfig.from_dict({"dataset_test_split": "test", "eval_split": "validation"})


def test_chat_template_kwargs_reach_every_rendering_of_a_chat(tmp_path, tokenizer):
    """Qwen3's enable_thinking and the like: the prompts the model is trained on, the tool messages of an
    episode, and verify's template check all render with them."""
    from covey import GRPOTrainer
    from covey.agents.chat import tool_message_ids
    from tests.test_trainer import ROWS, count_a, small_args
    from tests.conftest import make_model, make_tokenizer

    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}{% if flavour is defined %}/{{ flavour }}"
                               "{% endif %}: {{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>"
                               "assistant:{% endif %}")
    trainer = GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[count_a], train_dataset=ROWS,
                          processing_class=tokenizer, quiet=True,
                          args=small_args(tmp_path, eval_max_samples=0, chat_template_kwargs={"flavour": "plain"}))
    first_prompt = tokenizer.decode(trainer.parts.prompts.ids[0])
    assert "user/plain: say a" in first_prompt
    from covey.rewards import RewardModel
    from tests.test_reward_models import make_classifier

    judge_tokenizer = make_tokenizer()
    judge_tokenizer.chat_template = tokenizer.chat_template
    judge = RewardModel(make_classifier(len(judge_tokenizer)), judge_tokenizer)
    GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[judge], train_dataset=ROWS, processing_class=tokenizer,
                quiet=True, args=small_args(tmp_path, eval_max_samples=0, output_dir=str(tmp_path / "judged"),
                                            chat_template_kwargs={"flavour": "plain"}))
    assert "assistant/plain: hi" in judge.text(ROWS[0]["prompt"], [{"role": "assistant", "content": "hi"}])
    from covey.agents import calculate
    from covey.train.setup import build_agent

    agent = build_agent(small_args(tmp_path, chat_template_kwargs={"flavour": "plain"}), tokenizer, [calculate], None)
    appended, _ = tool_message_ids(agent.tokenizer, [{"role": "tool", "name": "f", "content": "1"}], [3],
                                   agent.chat_template_kwargs)  # as an episode renders its tool messages
    assert "tool/plain: 1" in tokenizer.decode(appended)
    assert not hasattr(tokenizer, "covey_chat_template_kwargs")  # passed where chats are rendered, not set on it
