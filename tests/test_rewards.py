import math
import textwrap

import pytest
import torch

from covey.errors import RewardError
from covey.core import weighted_reward_sum
from covey.rewards import (answer_correct, answer_format, is_correct, load_reward_func,
                           parse_number, score_completions)


def chat(text):
    return [{"role": "assistant", "content": text}]


def test_answer_format_gives_partial_credit():
    texts = ["no tags", "<answer>", "<answer>x</answer> more", "<answer>12</answer> more", "7 + 5 = 12\n<answer>12</answer>"]
    assert answer_format(completions=[chat(t) for t in texts]) == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_answer_correct_reads_tags_then_last_number():
    completions = ["<answer>12</answer>", "<answer>13</answer>", "5 + 7 = 12", "it is 11", "<answer>1,000</answer>"]
    scores = answer_correct(completions=completions, answer=["12", "12", "12", "12", "1000"])
    assert scores == [1.0, 0.0, 0.5, 0.0, 1.0]
    assert answer_correct(completions=["<answer>3</answer>"], answer=["n/a"]) == [None]


def test_is_correct_requires_tags():
    assert is_correct(chat("<answer> 42 </answer>"), "42")
    assert not is_correct(chat("42"), "42")
    assert not is_correct("<answer>41</answer>", 42)


@pytest.mark.parametrize("text, value", [("42", 42.0), ("-3.5", -3.5), ("1,234", 1234.0), (" 7. ", 7.0),
                                         ("x", None), ("", None), (5, 5.0)])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_user_reward_from_file_and_from_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def length_penalty(completions, **kwargs):
            return [-len(c) / 100 for c in completions]
    """))
    func = load_reward_func(f"{tmp_path / 'my_rewards.py'}:length_penalty")
    assert func(completions=["ab", "abcd"]) == [-0.02, -0.04]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_func("my_rewards:length_penalty")(completions=["a"]) == [-0.01]


@pytest.mark.parametrize("spec, message", [
    ("nope", "not a built-in"),
    ("missing_file.py:f", "does not exist"),
    ("no_such_module_xyz:f", "cannot import module"),
    ("math:no_such_function", "has no function named"),
])
def test_bad_reward_references_are_explained(spec, message):
    with pytest.raises(RewardError, match=message):
        load_reward_func(spec)


def test_dataset_columns_reach_rewards_aligned_with_completions():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, level, **kwargs):
        seen.update(answer=answer, level=level, n=len(completions), ids=completion_ids)
        return [float(a == c) for a, c in zip(answer, completions)]

    table = score_completions([spy], ["p1", "p2"], ["1", "3"], [[1], [3]], {"answer": ["1", "2"], "level": [0, 1]})
    assert seen == {"answer": ["1", "2"], "level": [0, 1], "n": 2, "ids": [[1], [3]]}
    assert table[:, 0].tolist() == [1.0, 0.0]


def test_wrong_number_of_values_names_the_function():
    def short(completions, **kw):
        return [1.0]

    with pytest.raises(RewardError, match="'short' returned 1 values for 2 completions"):
        score_completions([short], ["a", "b"], ["x", "y"], [[1], [2]], {})


@pytest.mark.parametrize("bad", ["1.0", float("nan"), [1.0], True])
def test_non_numbers_are_rejected(bad):
    def f(completions, **kw):
        return [0.0, bad]

    with pytest.raises(RewardError, match="'f' returned .* for completion 1"):
        score_completions([f], ["a", "b"], ["x", "y"], [[1], [2]], {})


def test_none_rewards_are_skipped_in_the_weighted_sum():
    table = torch.tensor([[1.0, math.nan], [math.nan, math.nan], [0.5, 2.0]], dtype=torch.float64)
    combined = weighted_reward_sum(table, torch.tensor([2.0, 0.5], dtype=torch.float64))
    assert combined[0] == 2.0 and combined[2] == 2.0 and math.isnan(combined[1])  # all None: no reward at all
