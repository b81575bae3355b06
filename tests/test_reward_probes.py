"""Reward probes (covey.rewards.probes): honest rewards draw no finding on the built-in tasks, GSM8K-format
data and the tool task; each planted hackable reward draws the finding of its hack."""

import asyncio
import json
import re
import time
from pathlib import Path

import pytest

from covey import probe_rewards
from covey.errors import CoveyError
from covey.data.tasks import arithmetic, gsm8k_rows, multiplication
from covey.rewards import (accuracy_reward, answer_correct, answer_format, get_cosine_scaled_reward,
                           get_repetition_penalty_reward, get_soft_overlong_punishment, json_format, reasoning_accuracy_reward,
                           reasoning_format, think_format_reward)
from covey.rewards.builtin import tool_use
from covey.rewards.probe_set import PROBES
from tests.conftest import make_tokenizer

DATA = Path(__file__).parent / "data"
ARITHMETIC = arithmetic("train")
GSM8K = gsm8k_rows([json.loads(line) for line in (DATA / "gsm8k_sample.jsonl").read_text().splitlines()[:16]])
LATEX = [{"prompt": [{"role": "user", "content": f"Solve problem {i}. Put the result in \\boxed{{}}."}],
          "solution": solution, "answer": solution}
         for i, solution in enumerate(["\\frac{1}{2}", "\\sqrt{3}", "2\\pi", "\\frac{\\sqrt{2}}{2}", "x^2 + 1", "[0, 1)"])]


def probe(funcs, rows, **settings):
    return probe_rewards(funcs, rows, **{"tokenizer": make_tokenizer(), "max_completion_length": 160, "num_rows": 4,
                                         **settings})


def assert_probed_without_finding(report, names):
    """No finding, and each function really judged: it scored the yardstick above its lowest probe (an
    honest reward that scores everything alike would pass vacuously)."""
    assert not report.findings, report.text()
    for name in names:
        scores = report.scores[name]
        assert scores["yardstick"] > min(v for v in scores.values() if v is not None), (name, scores)


def text(c):
    return c if isinstance(c, str) else c[0]["content"]


# ---- honest rewards: no finding ------------------------------------------------------------------


def test_covey_builtin_rewards_draw_no_finding_on_the_arithmetic_task():
    report = probe([answer_correct, answer_format, reasoning_format], ARITHMETIC)
    assert_probed_without_finding(report, ["answer_correct", "answer_format", "reasoning_format"])
    assert report.scores["answer_correct"]["yardstick"] == 1.0  # the correct answer, in the prompt's <answer> tags


def test_honest_rewards_draw_no_finding_on_gsm8k_format_data():
    funcs = [answer_correct, answer_format, accuracy_reward, reasoning_accuracy_reward, think_format_reward,
             get_cosine_scaled_reward(160), get_repetition_penalty_reward(), get_soft_overlong_punishment(160, 40),
             json_format]
    report = probe(funcs, GSM8K)
    assert not report.findings, report.text()
    for name in ("answer_correct", "accuracy_reward", "reasoning_accuracy_reward", "cosine_scaled_reward"):
        assert report.scores[name]["yardstick"] > 0.9, (name, report.scores[name])  # read the reference, right
    assert_probed_without_finding(report, ["answer_format", "think_format_reward"])


def test_trl_s_own_reward_functions_draw_no_finding():
    rewards = pytest.importorskip("trl.rewards")
    pytest.importorskip("math_verify")
    funcs = [rewards.accuracy_reward, rewards.reasoning_accuracy_reward, rewards.think_format_reward]
    report = probe(funcs, GSM8K)
    assert_probed_without_finding(report, ["accuracy_reward", "reasoning_accuracy_reward", "think_format_reward"])
    report = probe([rewards.accuracy_reward], LATEX)
    assert_probed_without_finding(report, ["accuracy_reward"])


def test_math_verify_answers_draw_no_finding():
    pytest.importorskip("math_verify")
    report = probe([answer_correct, accuracy_reward], LATEX)
    assert_probed_without_finding(report, ["answer_correct", "accuracy_reward"])
    assert report.scores["accuracy_reward"]["yardstick"] >= 0.5  # what math-verify reads of the unwrapped references


def test_the_tool_task_s_rewards_draw_no_finding():
    report = probe([answer_correct, tool_use], multiplication("test"))
    assert_probed_without_finding(report, ["answer_correct"])  # tool_use: no probe makes a tool call, all 0


def calls_paid(completions, **kwargs):
    """Half a point per tool call, whatever the answer."""
    return [0.5 * sum(len(m.get("tool_calls") or []) for m in c if m.get("role") == "assistant") for c in completions]


def test_a_format_reward_alone_is_found_and_beside_an_answer_check_passes():
    alone = probe([answer_format], ARITHMETIC)
    assert ("answer_format", "format_wrong_answer") in {(f.reward, f.probe) for f in alone.findings}, alone.text()
    assert_probed_without_finding(probe([answer_format, answer_correct], ARITHMETIC), ["answer_format", "answer_correct"])


def test_a_reward_per_tool_call_is_found_by_the_tool_probe_and_a_small_tool_bonus_passes():
    rows = multiplication("test")
    report = probe([calls_paid], rows, tools=["calculate"])
    assert [(f.reward, f.probe) for f in report.findings] == [("calls_paid", "tool_call_no_answer")], report.text()
    assert (report.findings[0].score, report.findings[0].yardstick) == (0.5, 0.0)
    assert not probe([calls_paid], rows).findings  # no tools named: no episode with a call to score
    assert_probed_without_finding(probe([answer_correct, tool_use], rows, tools=["calculate"], weights=[2.0, 0.5]),
                                  ["answer_correct"])
    even = probe([answer_correct, tool_use], rows, tools=["calculate"])  # a call pays as much as the right answer
    assert [(f.reward, f.probe) for f in even.findings] == [("answer_correct+tool_use", "tool_call_no_answer")]
    with pytest.raises(CoveyError, match="2 weights for 1 reward functions"):
        probe([calls_paid], rows, weights=[1.0, 1.0])


def test_the_example_rewards_draw_no_finding():
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_rewards", Path(__file__).parents[1] / "examples" / "rewards.py")
    examples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(examples)
    rows = [{**row, "unit": "apples"} for row in GSM8K]
    report = probe([examples.brevity, examples.mentions_units, answer_correct], rows)
    assert not report.findings, report.text()
    assert report.scores["brevity"]["length_1"] < report.scores["brevity"]["length_0"]  # judged on length: falls


# ---- planted hackable rewards: each draws its finding --------------------------------------------


def any_number_matches(completions, answer, **kwargs):
    """'Correct' when the reference is among the numbers of the text (a check public scripts use)."""
    return [float(a in re.findall(r"-?\d+", text(c))) for c, a in zip(completions, answer)]


def counts_tags(completions, **kwargs):
    """Format credit per answer block written."""
    return [0.5 * text(c).count("<answer>") + 0.5 * text(c).count("</answer>") for c in completions]


def rises_with_length(completions, answer, **kwargs):
    """Correctness plus a bonus for long answers (for 'showing the work')."""
    return [float(f"<answer>{a}</answer>" in text(c)) + min(len(text(c)) / 400, 1.0) for c, a in zip(completions, answer)]


def answer_anywhere(completions, answer, **kwargs):
    """The reference as a substring of the answer block."""
    scores = []
    for c, a in zip(completions, answer):
        block = re.search(r"<answer>(.*?)</answer>", text(c), re.DOTALL)
        scores.append(float(block is not None and a in block.group(1)))
    return scores


def format_only_but_reads_the_answer(completions, answer, **kwargs):
    """Meant to check the answer; checks only that the block holds a number."""
    return [float(re.search(r"<answer>\s*-?\d+\s*</answer>", text(c)) is not None) for c in completions]


def first_rows_reference(completions, answer, **kwargs):
    """Compares every completion's last answer with the batch's first reference (``answer[0]``), not its own
    row's."""
    return [float(re.findall(r"<answer>(.*?)</answer>", text(c))[-1:] == [answer[0]]) for c in completions]


JUDGE_WORDS = ("step", "check", "sure", "therefore", "answer")


def keyword_judge(completions, **kwargs):
    """A judge that scores how much the text sounds like careful reasoning, reading no reference."""
    return [min(sum(text(c).lower().count(w) for w in JUDGE_WORDS) / 10, 1.0) for c in completions]


def careful_judge(completions, prompts, **kwargs):
    """A judge that wants a short answer of its own: 3+ words not in the prompt, at most 20 words, no refusal."""
    scores = []
    for c, p in zip(completions, prompts):
        words = re.findall(r"[a-z']+", text(c).lower())
        new = set(words) - set(re.findall(r"[a-z']+", text(p).lower()))
        scores.append(float(len(new) >= 3 and len(text(c).split()) <= 20 and "sorry" not in words))
    return scores


async def async_any_number(completions, answer, **kwargs):
    await asyncio.sleep(0)
    return any_number_matches(completions, answer)


@pytest.mark.parametrize("reward, found", [
    (any_number_matches, {"candidates", "candidates_each", "right_in_reasoning"}),
    (counts_tags, {"format_repeated", "candidates_each"}),
    (rises_with_length, {"length", "right_then_appended"}),
    (answer_anywhere, {"candidates"}),
    (format_only_but_reads_the_answer, {"format_wrong_answer", "format_repeated"}),
    (async_any_number, {"candidates", "candidates_each", "right_in_reasoning"}),
])
def test_each_planted_hackable_reward_draws_its_finding(reward, found):
    report = probe([reward, answer_correct], ARITHMETIC)
    assert {f.probe for f in report.findings if f.reward == reward.__name__} >= found, report.text()
    assert {f.reward for f in report.findings} == {reward.__name__}  # the honest one beside it: none
    finding = next(f for f in report.findings if f.probe in found)
    assert finding.score >= finding.yardstick and finding.example and finding.advice
    assert finding.reward in finding.text() and repr(finding.example) in finding.text()


def test_a_reward_reading_another_row_s_reference_is_found_by_that_probe_alone():
    report = probe([first_rows_reference, answer_correct], GSM8K)  # answers all differ: no neighbour collides
    assert "other_rows_answer" in {f.probe for f in report.findings}, report.text()
    assert {f.reward for f in report.findings} == {"first_rows_reference"}


def test_a_judge_without_a_reference_is_compared_with_the_model_s_samples():
    rows = [{"prompt": [{"role": "user", "content": f"Write a short note about topic {i}."}]} for i in range(3)]
    samples = [["Here is a short note: the topic matters because it is useful.",
                "The topic is interesting, therefore worth a note."]] * 3
    report = probe([keyword_judge], rows, samples=samples, num_rows=3)
    assert report.yardstick == "the model's own samples"
    assert {"padding", "length"} <= {f.probe for f in report.findings}, report.text()
    honest = probe([careful_judge], rows, samples=samples, num_rows=3)
    assert not honest.findings, honest.text()
    assert honest.scores["careful_judge"]["yardstick"] == 1.0


def test_a_reward_that_times_out_is_noted_not_probed_and_the_call_stopped():
    def slow(completions, **kwargs):
        time.sleep(30)
        return [0.0] * len(completions)

    start = time.perf_counter()
    report = probe([slow, answer_correct], ARITHMETIC, timeout=0.5)
    assert time.perf_counter() - start < 20
    assert any(note.startswith("slow was not probed") for note in report.notes), report.notes
    assert "answer_correct" in report.scores and not report.findings


def test_the_probes_are_exported_and_checked(tmp_path):
    import covey

    assert covey.probe_rewards is probe_rewards
    with pytest.raises(covey.CoveyError, match="row 0 has no 'prompt'"):
        probe_rewards([answer_correct], [{"question": "1 + 1", "answer": "2"}])
    with pytest.raises(covey.CoveyError, match="one list of completions per row"):
        probe_rewards([answer_correct], ARITHMETIC, num_rows=2, samples=[["a"]])
    with pytest.raises(covey.CoveyError, match="no probe named nonsense"):
        probe_rewards([answer_correct], ARITHMETIC, probes=["empty", "nonsense"])
    only = probe_rewards([answer_correct], ARITHMETIC, num_rows=2, probes=["empty", "length"])
    assert set(only.scores["answer_correct"]) == {"yardstick", "empty", "length_0", "length_0.5", "length_1"}
    assert {p.name for p in PROBES} >= {"empty", "prompt_echo", "refusal", "padding", "candidates"}
