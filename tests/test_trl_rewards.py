"""TRL's built-in rewards under their names, checked against TRL's own functions on the same inputs;
and answers compared by math-verify (answer_correct's non-numeric references), in threads and under
covey's time limit."""

import threading
import time

import pytest

import covey.rewards.symbolic as symbolic
from covey.errors import RewardError
from covey.rewards import (accuracy_reward, answer_correct, get_cosine_scaled_reward, get_repetition_penalty_reward,
                           get_soft_overlong_punishment, load_reward_func, reasoning_accuracy_reward, reward_name,
                           think_format_reward)

trl_rewards = pytest.importorskip("trl.rewards", reason="trl is a dev dependency: pip install -e .[dev]")
needs_math_verify = pytest.mark.skipif(not symbolic.available(), reason="math-verify is not installed: "
                                       "pip install -e .[math]")


def chat(text):
    return [{"role": "assistant", "content": text}]


THINKING = ["<think>\nreasoning\n</think>\nanswer", "<think>\nreasoning\nanswer", "answer <think>x</think>",
            "<think>a</think><think>b</think>", "<think></think>", "", "<think>\n\n</think>\n"]
IDS = [[], [1], [1, 2, 3], [1] * 7, [1] * 8, [1] * 9, [1] * 20, [4, 5, 4, 5, 4, 5], [1, 2, 3, 1, 2, 3, 1, 2]]
SOLUTIONS = [r"\frac{1}{3}", r"\frac{1}{3}", "$[0, 1)$", r"$\{1, 2\}$", "72", r"\frac{\sqrt{3}}{2}", "nothing"]
ANSWERS = [r"so \boxed{\frac{1}{3}}", r"it is $\frac{1}{2}$", r"the interval $[0,1)$", r"$\boxed{\{2, 1\}}$",
           r"$72$ dollars", r"\boxed{\sqrt{3}/2}", r"\boxed{1}"]


def test_think_format_reward_matches_trl():
    completions = [chat(t) for t in THINKING]
    assert think_format_reward(completions) == trl_rewards.think_format_reward(completions)
    assert think_format_reward(THINKING) == think_format_reward(completions)  # plain text reads the same


@pytest.mark.parametrize("max_len, cache", [(8, 2), (8, 0), (10, 10)])
def test_soft_overlong_punishment_matches_trl_and_is_covey_s_penalty(max_len, cache):
    ours, theirs = get_soft_overlong_punishment(max_len, cache), trl_rewards.get_soft_overlong_punishment(max_len, cache)
    assert ours(IDS) == theirs(IDS)
    assert reward_name(ours) == theirs.__name__ == "soft_overlong_punishment_reward"
    if cache:  # the built-in soft_overlong_penalty is the same function
        built_in = load_reward_func("soft_overlong_penalty", {"soft_overlong_penalty": {"max_length": max_len,
                                                                                         "cache_length": cache}})
        assert built_in(IDS) == ours(IDS)
    with pytest.raises(RewardError, match="need 0 <= cache_length"):
        get_soft_overlong_punishment(4, 5)


@pytest.mark.parametrize("ngram, penalty", [(3, -1.0), (2, -0.5), (1, -1.0)])
def test_repetition_penalty_matches_trl(ngram, penalty):
    ours, theirs = get_repetition_penalty_reward(ngram, penalty), trl_rewards.get_repetition_penalty_reward(ngram, penalty)
    assert ours(IDS) == pytest.approx(theirs(IDS))
    assert reward_name(ours) == theirs.__name__
    with pytest.raises(ValueError, match="must not be positive"):
        get_repetition_penalty_reward(max_penalty=0.5)


def test_trl_names_load_and_factories_say_how_to_use_them():
    assert load_reward_func("accuracy_reward") is accuracy_reward
    assert load_reward_func("think_format_reward") is think_format_reward
    assert load_reward_func("reasoning_accuracy_reward") is reasoning_accuracy_reward
    with pytest.raises(RewardError, match=r"from covey.rewards import get_soft_overlong_punishment.*soft_overlong_penalty"):
        load_reward_func("get_soft_overlong_punishment")
    with pytest.raises(RewardError, match=r"call it in Python"):
        load_reward_func("get_cosine_scaled_reward")


def test_rewards_that_need_math_verify_say_so_when_loaded_without_it(monkeypatch):
    monkeypatch.setattr(symbolic, "available", lambda: False)
    for reward in ("accuracy_reward", "reasoning_accuracy_reward", get_cosine_scaled_reward(max_len=8)):
        with pytest.raises(RewardError, match=r"compares answers with math-verify, which is not installed: pip install"):
            load_reward_func(reward)
    assert load_reward_func("think_format_reward") is think_format_reward


@needs_math_verify
def test_accuracy_reward_matches_trl_with_what_it_logs():
    completions = [chat(a) for a in ANSWERS]
    ours_logged, theirs_logged = {}, {}
    ours = accuracy_reward(completions, SOLUTIONS, log_extra=ours_logged.__setitem__)
    theirs = trl_rewards.accuracy_reward(completions, SOLUTIONS, log_extra=theirs_logged.__setitem__)
    assert ours == theirs
    assert ours[0] == 1.0 and ours[1] == 0.0 and None in ours  # right, wrong, and a solution that is no mathematics
    assert ours_logged == theirs_logged


@needs_math_verify
def test_reasoning_accuracy_and_cosine_scaled_rewards_match_trl():
    texts = [f"<think>try \\boxed{{9}}</think> {a}" if i % 2 else a for i, a in enumerate(ANSWERS)]
    completions = [chat(t) for t in texts]
    for delimiters in (None, ["</think>", "Answer:"]):
        assert (reasoning_accuracy_reward(completions, SOLUTIONS, reasoning_delimiters=delimiters)
                == trl_rewards.reasoning_accuracy_reward(completions, SOLUTIONS, reasoning_delimiters=delimiters))
    ids = [[1] * (5 * i) for i in range(len(ANSWERS))]
    ours, theirs = get_cosine_scaled_reward(max_len=20), trl_rewards.get_cosine_scaled_reward(max_len=20)
    assert ours(completions, SOLUTIONS, ids) == pytest.approx(theirs(completions, SOLUTIONS, ids))
    assert reward_name(ours) == theirs.__name__


@needs_math_verify
def test_answer_correct_compares_non_numeric_references_with_math_verify(monkeypatch):
    references = [r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt{3}}{2}", "[0, 1)", "[0, 1)", r"\{1, 2\}", "#### 2\\sqrt{2}",
                  r"\frac{\sqrt{3}}{2}", "#### 72", "3/4", ""]
    completions = ["<answer>\\sqrt{3}/2</answer>", "<answer>0.5</answer>", "<answer>[0,1)</answer>",
                   "<answer>(0,1)</answer>", "<answer>\\{2, 1\\}</answer>", "<answer>\\sqrt{8}</answer>",
                   "no tags, but finally $\\frac{\\sqrt{3}}{2}$", "<answer>72</answer>", "<answer>0.75</answer>",
                   "<answer>1</answer>"]
    assert answer_correct(completions, references) == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5, 1.0, 1.0, None]

    def numbers_not_sent(comparisons):
        assert not comparisons, "a number is compared by covey itself"
        return []

    monkeypatch.setattr(symbolic, "verdicts", numbers_not_sent)
    assert answer_correct(completions[7:9], references[7:9]) == [1.0, 1.0]
    monkeypatch.setattr(symbolic, "available", lambda: False)  # without math-verify: not scored, as documented
    assert answer_correct(completions, references) == [None] * 7 + [1.0, 1.0, None]


@needs_math_verify
def test_math_verify_runs_in_threads_and_a_hung_comparison_is_cut_off(monkeypatch):
    results = []
    threads = [threading.Thread(target=lambda: results.append(accuracy_reward([chat(a) for a in ANSWERS], SOLUTIONS)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [trl_rewards.accuracy_reward([chat(a) for a in ANSWERS], SOLUTIONS)] * 2
    monkeypatch.setattr(symbolic, "TIME_LIMIT", 1.0)
    hung = "9^{9^{9}} - 9^{9^{9}}"  # sympy works out both powers, hundreds of millions of digits, in one C call
    started = time.monotonic()
    scored = []
    thread = threading.Thread(target=lambda: scored.append(
        answer_correct(["<answer>5</answer>", "<answer>\\sqrt{4}</answer>"], [hung, "2\\sqrt{1}"])))
    thread.start()
    thread.join(30)
    assert scored == [[0.0, 1.0]] and time.monotonic() - started < 15
    assert answer_correct(["<answer>\\frac{2}{4}</answer>"], [r"\frac{1}{2}\cdot 1"]) == [1.0]  # workers replaced


@needs_math_verify
@pytest.mark.parametrize("workers, timeout", [(0, 30.0), (1, None), (1, 30.0)])
def test_math_verify_scores_the_same_in_a_reward_worker_and_under_reward_timeout(workers, timeout):
    from covey.rewards import RewardPool, score_completions

    completions = ["<answer>$\\sqrt{3}/2$</answer>", "<answer>$[0, 1]$</answer>", "<answer>$\\sqrt{8}$</answer>"]
    columns = {"answer": [r"\frac{\sqrt{3}}{2}", "[0, 1)", r"2\sqrt{2}"]}
    with RewardPool([answer_correct, accuracy_reward], workers) as pool:
        table = score_completions([answer_correct, accuracy_reward], [""] * 3, completions, [[]] * 3,
                                  {**columns, "solution": [f"${a}$" for a in columns["answer"]]}, timeout=timeout,
                                  pool=pool)
    assert table[:, 0].tolist() == [1.0, 0.0, 1.0]
    assert table[:, 1].tolist() == [1.0, 0.0, 1.0]
