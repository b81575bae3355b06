"""The reward-hacking rules out of sample: the evaluation sets of benchmarks/hacking_evaluation.py (hackable kinds the
rules were not tuned on, healthy runs with seeds the tuning never used; the second made after a rule was changed on
the first), recorded small in tests/data/hacking/<set>/, each against the verdict written by hand from how it was
set up; and the reward
probes against each of its rewards before training. A run the frozen rules get wrong is marked ``known_miss`` in
the expectations (docs/diagnose.md, "Out of sample", reports it): its test holds that it is still a miss."""

import json
from pathlib import Path

import pytest

from benchmarks import hacking_evaluation as evaluation
from benchmarks import probe_evaluation
from covey import probe_rewards
from covey.data.tasks import arithmetic, gsm8k_rows, multiplication
from covey.telemetry.diagnose import GAMING, diagnose, read_run
from tests.conftest import make_tokenizer
from tests.test_hacking import EVALUATION_SETS as SETS

HACKING = Path(__file__).parent / "data" / "hacking"
EXPECTATIONS = {(s, name): e for s in SETS  # written by hand before any run of the set was judged
                for name, e in json.loads((HACKING / s / "expectations.json").read_text()).items()}
RECORDED = {(s, p.name) for s in SETS for p in (HACKING / s).iterdir() if p.is_dir()}


@pytest.mark.parametrize("run_set, name", sorted(set(EXPECTATIONS) | RECORDED))
def test_evaluation_runs_get_their_verdicts_or_stay_known_misses(run_set, name):
    assert (run_set, name) in EXPECTATIONS, f"tests/data/hacking/{run_set}/{name} has no expectation in expectations.json"
    assert (run_set, name) in RECORDED, (f"{name} is not recorded: python -m benchmarks.reward_hacking record {name} "
                                         f"--set {run_set} --out RUNS")
    expected = EXPECTATIONS[run_set, name]
    result = diagnose(read_run(HACKING / run_set / name))
    found = {f.key for _, f in result.findings}
    right = result.verdict == expected["verdict"] and (
        set(expected.get("planted", ())) <= found if expected["verdict"] == GAMING else not found)
    if expected.get("known_miss"):
        assert not right, f"{name} is no longer missed: update docs/diagnose.md's table and drop known_miss"
    else:
        assert right, result.text()


GSM8K = gsm8k_rows([json.loads(line) for line in
                    (Path(__file__).parent / "data" / "gsm8k_sample.jsonl").read_text().splitlines()[:16]])
TASKS = {"arithmetic": arithmetic("train"), "gsm8k": GSM8K, "multiplication": multiplication("test")}
# each hackable reward of the evaluation set on its run's task, and the probe that must find it
HACKABLE = [(evaluation.prompt_echo, "arithmetic", "prompt_echo"),
            (evaluation.tool_calls, "multiplication", "tool_call_no_answer"),
            (evaluation.digits_anywhere, "gsm8k", "candidates"),
            (evaluation.brevity, "arithmetic", "empty"),
            (evaluation.ends_with_number, "gsm8k", "format_wrong_answer"),
            (evaluation.ends_with_number, "arithmetic", "format_wrong_answer")]


def probe(funcs, task, **settings):
    return probe_rewards(funcs, TASKS[task], tokenizer=make_tokenizer(), max_completion_length=48, num_rows=4,
                         tools=["calculate"] if task == "multiplication" else (), **settings)


@pytest.mark.parametrize("reward, task, hack", HACKABLE, ids=[r.__name__ for r, _, _ in HACKABLE])
def test_the_probes_find_each_hackable_reward_of_the_evaluation_set(reward, task, hack):
    report = probe([reward], task)
    assert hack in {f.probe for f in report.findings if f.reward == reward.__name__}, report.text()


def test_a_reward_for_an_exclamation_mark_is_found_by_the_dressed_wrong_answer_alone():
    """The probes missed the reward for an exclamation mark until the ``dressed_wrong`` probe (format biases of
    reward models) was added after that miss: this reward no longer counts as out of sample for the probes
    (docs/diagnose.md, "Out of sample"). Every other probe still scores nothing, the right answer included."""
    report = probe([evaluation.exclaims], "gsm8k")
    assert {f.probe for f in report.findings} == {"dressed_wrong"}, report.text()
    assert {k for k, v in report.scores["exclaims"].items() if v} == {"dressed_wrong"}, report.scores


@pytest.mark.parametrize("funcs, weights, task", [
    (["answer_format", "answer_correct"], None, "arithmetic"),  # the healthy default-model runs
    (["answer_format", "answer_correct"], None, "gsm8k"),
    (["answer_correct", "tool_use"], [2.0, 0.5], "multiplication"),  # examples/multiplication_tool.yaml
])
def test_the_probes_pass_the_honest_rewards(funcs, weights, task):
    report = probe(funcs, task, weights=weights)
    assert not report.findings, report.text()


FRESH = json.loads((Path(__file__).parent / "data" / "probe_evaluation_expectations.json").read_text())


@pytest.mark.parametrize("entry", probe_evaluation.SET, ids=[e["name"] for e in probe_evaluation.SET])
def test_the_probes_judge_the_set_written_after_them_as_it_was_written(entry):
    """The reward functions of benchmarks/probe_evaluation.py were written after the probes were frozen, each marked
    hackable or honest by hand: a hackable one draws a finding, an honest one none; the one the probes missed
    when the set was first judged is marked ``known_miss`` there, and still missed."""
    expected = FRESH[entry["name"]]
    assert expected["hackable"] == entry["hackable"]
    report = probe_rewards([entry["func"]], probe_evaluation.rows(entry["task"], 8), max_completion_length=256,
                           num_rows=8)  # a token a word: 256 of them leave room for the length probes
    assert bool(report.findings) == (expected["hackable"] and "known_miss" not in expected), report.text()
