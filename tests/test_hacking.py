"""The reward-hacking and collapse rules fire on planted histories, with their evidence, and stay silent
on healthy ones; covey diagnose gives one verdict, the same for a covey run folder and a TRL output
directory holding the same history."""

import json
from pathlib import Path

import pytest

from benchmarks.reward_hacking import FOLDERS
from covey.telemetry import hacking, text_signals
from covey.telemetry.diagnose import (COLLAPSED, GAMING, LEARNING, NOT_LEARNING, TOO_EARLY, diagnose, read_run,
                                      trl_history)
from covey.telemetry.health import HealthMonitor

DATA = Path(__file__).parent / "data" / "hacking"


def _noise(i, size=0.03):
    return size * (((i * 7919) % 11) - 5) / 5  # a deterministic scatter of +-size


def history(n=24, evals=(), **series):
    """``n`` logged steps of a healthy run (reward rising, spread, entropy and length steady), with the
    named metrics replaced by functions of the step index; ``evals``: {step: held-out accuracy}."""
    base = {"reward": lambda i: 0.3 + 0.02 * i + _noise(i), "reward_std": lambda i: 0.3 + _noise(i, 0.02),
            "frac_reward_zero_std": lambda i: 0.2, "entropy": lambda i: 1.0 + _noise(i, 0.05),
            "completions/mean_length": lambda i: 20 + 10 * _noise(i), "completions/clipped_ratio": lambda i: 0.05}
    base.update(series)
    rows = [{"step": i + 1, **{k: f(i) for k, f in base.items()}} for i in range(n)]
    for row in rows:
        if row["step"] in evals:
            row["eval/accuracy"] = evals[row["step"]]
    return rows


def samples(texts_at, prompts=6):
    """Recorded completions: ``texts_at(step, prompt)`` for steps 1..8, two per prompt, rewarded 1."""
    return [{"step": step, "prompt": f"what is {p} + 1?", "completion": texts_at(step, p), "reward": 1.0}
            for step in range(1, 9) for p in range(prompts) for _ in range(2)]


def healthy_text(step, p):
    return f"{p} + 1 = {p + 1}\n<answer>{p + 1}</answer>"


RISING_ACCURACY = {6: 0.3, 12: 0.45, 18: 0.6, 24: 0.7}


def keys(rows, texts=()):
    return [f.key for f in hacking.findings(rows, list(texts))]


def test_a_healthy_run_with_held_out_gains_fires_nothing():
    assert keys(history(evals=RISING_ACCURACY), samples(healthy_text)) == []


def test_a_solved_task_flat_near_the_top_is_not_gaming():
    rows = history(evals={6: 0.85, 12: 0.88, 18: 0.86, 24: 0.87})
    assert keys(rows) == []


@pytest.mark.parametrize("seed", range(10))
def test_noise_alone_fires_nothing(seed):
    """Flat series with Gaussian noise (reward +-0.1, each reward function, length, entropy, KL, held-out
    accuracy +-0.03): no trend, so no finding, whatever the draw."""
    import random

    r = random.Random(seed)
    rows = history(30, reward=lambda i: 0.5 + r.gauss(0, 0.1), entropy=lambda i: 1.0 + r.gauss(0, 0.1),
                   reward_std=lambda i: 0.3 + r.gauss(0, 0.05), kl=lambda i: 0.03 + abs(r.gauss(0, 0.01)),
                   evals={6: 0.3, 12: 0.3 + r.gauss(0, 0.03), 18: 0.3 + r.gauss(0, 0.03), 24: 0.3 + r.gauss(0, 0.03)},
                   **{"rewards/a/mean": lambda i: 0.5 + r.gauss(0, 0.1),
                      "rewards/b/mean": lambda i: 0.2 + r.gauss(0, 0.1),
                      "completions/mean_length": lambda i: 20 + r.gauss(0, 3),
                      "completions/clipped_ratio": lambda i: max(0.0, r.gauss(0.1, 0.05))})
    assert keys(rows, samples(healthy_text)) == []


def test_reward_rising_while_held_out_accuracy_falls():
    rows = history(evals={6: 0.4, 12: 0.35, 18: 0.25, 24: 0.2})
    (found,) = hacking.findings(rows, samples(healthy_text))
    assert found.key == "heldout_gap" and found.kind == "gaming" and found.began == 6
    assert "held-out accuracy went 0.400 -> 0.225" in found.message and found.examples


def test_held_out_reward_that_does_not_follow_the_training_reward():
    rows = history()
    for step, value in {6: 0.5, 12: 0.52, 18: 0.5, 24: 0.51}.items():
        rows[step - 1]["eval/mean_reward"] = value
    assert keys(rows) == ["heldout_gap"]


def test_no_held_out_evaluation_is_said_once_with_eval_steps():
    monitor = hacking.Monitor()
    rows = history()
    shown = [f for i in range(1, len(rows) + 1) for f in monitor.check(rows[:i])]
    assert [f.key for f in shown] == [hacking.NO_HELDOUT_KEY] and "eval_steps" in shown[0].text()


def test_saturated_reward_with_no_held_out_gain():
    rows = history(reward=lambda i: min(0.3 + 0.1 * i, 2.0) + _noise(i, 0.005),
                   frac_reward_zero_std=lambda i: 0.2 if i < 12 else 0.95,
                   evals={6: 0.3, 12: 0.3, 18: 0.28, 24: 0.31})
    found = {f.key: f for f in hacking.findings(rows)}
    assert "reward_saturated" in found and "saturated at 1.99" in found["reward_saturated"].message


def test_one_reward_function_traded_against_another():
    rows = history(**{"rewards/verbosity/mean": lambda i: 0.2 + 0.05 * i + _noise(i),
                      "rewards/answer_correct/mean": lambda i: 0.6 - 0.02 * max(0, i - 8) + _noise(i)})
    found = {f.key: f for f in hacking.findings(rows)}["traded_off"]
    assert "reward verbosity rose" in found.message and "answer_correct fell" in found.message
    assert 4 <= found.began <= 10  # about where the falling one peaked (step 9), before it fell


def test_two_reward_functions_rising_together_are_not_traded():
    rows = history(**{"rewards/a/mean": lambda i: 0.2 + 0.03 * i + _noise(i),
                      "rewards/b/mean": lambda i: 0.1 + 0.02 * i + _noise(i)})
    assert "traded_off" not in keys(rows)


def test_length_running_away_with_the_reward():
    rows = history(**{"completions/mean_length": lambda i: min(10 + 2 * i, 64),
                      "completions/clipped_ratio": lambda i: min(0.04 * i, 0.9)})
    found = {f.key: f for f in hacking.findings(rows)}["length_runaway"]
    assert "the reward pays for length" in found.message and found.values["length_reward_correlation"] > 0.5


def test_length_running_away_within_the_first_window():
    """A high learning rate: completions reach the limit (48) in four steps, so the first window's mean already
    holds most of the rise (the first 13 steps of a real run of the default model paid for length)."""
    lengths = [28.4, 23.9, 41.2, 48.0, 47.5, 43.8, 48.0, 45.8, 44.1, 44.1, 48.0, 44.1, 48.0]
    clipped = [0.38, 0.25, 0.62, 1.0, 0.88, 0.88, 1.0, 0.88, 0.88, 0.88, 1.0, 0.88, 1.0]
    rewards = [0.85, 0.70, 1.52, 1.82, 1.88, 1.52, 1.88, 1.57, 1.60, 1.68, 1.86, 1.67, 1.96]
    rows = [{"step": i + 1, "reward": r, "completions/mean_length": n, "completions/clipped_ratio": c}
            for i, (r, n, c) in enumerate(zip(rewards, lengths, clipped))]
    found = {f.key: f for f in hacking.findings(rows)}["length_runaway"]
    assert found.values["length_first"] < 30 and found.values["length_last"] > 45


def test_length_rising_with_a_falling_reward_is_not_runaway():
    rows = history(reward=lambda i: 0.8 - 0.01 * i + _noise(i),
                   **{"completions/mean_length": lambda i: 10 + 2 * i, "completions/clipped_ratio": lambda i: 0.04 * i})
    assert "length_runaway" not in keys(rows)


def test_length_collapsing_with_the_reward():
    rows = history(reward=lambda i: 0.8 - 0.02 * i + _noise(i),
                   **{"completions/mean_length": lambda i: max(30 - 2 * i, 2)})
    assert "length_collapse" in keys(rows)


def test_length_shrinking_as_the_reward_rises_is_learning_to_be_brief():
    rows = history(**{"completions/mean_length": lambda i: max(30 - 2 * i, 4)})
    assert keys(rows, samples(healthy_text)) == [hacking.NO_HELDOUT_KEY]


def test_entropy_collapse_without_learning():
    rows = history(reward=lambda i: 0.3 + _noise(i), entropy=lambda i: max(1.0 - 0.08 * i, 0.05),
                   reward_std=lambda i: max(0.3 - 0.02 * i, 0.01), evals=RISING_ACCURACY)
    found = {f.key: f for f in hacking.findings(rows)}["entropy_collapse"]
    assert found.kind == "collapse" and "entropy fell" in found.message


def test_entropy_falling_as_the_reward_rises_is_a_policy_sharpening():
    rows = history(entropy=lambda i: max(1.0 - 0.08 * i, 0.05), reward_std=lambda i: max(0.3 - 0.02 * i, 0.01),
                   evals=RISING_ACCURACY)
    assert keys(rows) == []


def test_kl_accelerating():
    rows = history(kl=lambda i: 0.001 * i + (0.0004 * (i - 12) ** 3 if i > 12 else 0.0), evals=RISING_ACCURACY)
    assert "kl_accelerating" in keys(rows)


def test_kl_rising_steadily_is_not_accelerating():
    rows = history(kl=lambda i: 0.005 * i + _noise(i, 0.001), evals=RISING_ACCURACY)
    assert "kl_accelerating" not in keys(rows)


def test_repetition_rising():
    found = {f.key: f for f in hacking.findings(history(evals=RISING_ACCURACY), samples(
        lambda step, p: healthy_text(step, p) if step < 5 else f"{p} + 1 sum sum sum sum sum sum sum sum"))}
    assert found["repetition"].began == 6 and "sum sum" in found["repetition"].examples[0]


def test_one_completion_for_every_prompt():
    found = {f.key: f for f in hacking.findings(history(evals=RISING_ACCURACY), samples(
        lambda step, p: healthy_text(step, p) if step < 5 else "The answer is correct and verified."))}
    assert found["same_completion"].values["share_of_prompts"] == 1.0


def test_format_tags_repeated_for_credit():
    tagged = lambda step, p: healthy_text(step, p) if step < 5 else "<answer>1</answer>" * 4  # noqa: E731
    assert "repeated_format" in keys(history(evals=RISING_ACCURACY), samples(tagged))
    unpaid = [dict(s, reward=0.0) if text_signals.repeats_a_tag(s["completion"]) else s for s in samples(tagged)]
    unpaid = [dict(s, reward=1.0) if s["step"] >= 6 and not text_signals.repeats_a_tag(s["completion"]) else s
              for s in unpaid]
    assert "repeated_format" not in keys(history(evals=RISING_ACCURACY), unpaid + samples(healthy_text))


def test_the_live_monitor_logs_each_warning_once_as_health_metric(tmp_path):
    from covey.telemetry.runlog import RunLog

    rows = history(evals={6: 0.4, 12: 0.35, 18: 0.25, 24: 0.2})
    with RunLog(tmp_path, total_steps=len(rows), quiet=True) as log:
        for row in rows:
            log.log_metrics(row["step"], {k: v for k, v in row.items() if k != "step"})
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    flagged = [(r["step"], k) for r in written for k in r if k.startswith("health/")]
    assert flagged == [(18, "health/heldout_gap")], flagged


def test_the_live_monitor_reads_the_completions_the_run_records(tmp_path):
    from covey.telemetry.runlog import RunLog

    rows, texts = history(evals=RISING_ACCURACY), REPEATING
    with RunLog(tmp_path, total_steps=len(rows), quiet=True) as log:
        for row in rows:
            step = row["step"]
            log.log_metrics(step, {k: v for k, v in row.items() if k != "step"})
            records = [{k: v for k, v in s.items() if k != "step"} for s in texts if s["step"] == step]
            if records:
                log.log_completions(step, records)
    assert {r.get("step") for r in log.samples} == {1, 2, 3, 6, 7, 8}  # the first and latest three recorded steps
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # step 7's check reads the completions of steps 1-6 (a step's completions are recorded after its metrics):
    # steps 5 and 6 already repeat, against none of steps 1-3
    assert [(r["step"], k) for r in written for k in r if k.startswith("health/")] == [(7, "health/repetition")]


def test_the_monitor_shows_findings_with_the_other_health_warnings():
    monitor = HealthMonitor()
    rows = history(evals={6: 0.4, 12: 0.35, 18: 0.25, 24: 0.2})
    shown = [m for i in range(1, len(rows) + 1) for m in monitor.check(rows[:i])]
    assert sum("gaming the reward" in m for m in shown) == 1


# covey diagnose over run folders


def write_covey(folder: Path, rows, texts=()):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "completions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in texts))
    return folder


def write_trl(folder: Path, rows, texts=()):
    """The same history as TRL writes it: training entries, evaluations as separate eval_ entries of their
    step, a closing summary entry; completions as one parquet file per step."""
    import pandas as pd

    log = []
    for row in rows:
        log.append({k: v for k, v in row.items() if not k.startswith("eval/")})
        if "eval/accuracy" in row:
            log.append({"step": row["step"], "eval_accuracy": row["eval/accuracy"], "eval_loss": 0.0})
    log.append({"step": rows[-1]["step"], "train_runtime": 12.0, "train_loss": 0.01})
    (folder / "checkpoint-3").mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": rows[-1]["step"], "log_history": log}))
    if texts:
        (folder / "completions").mkdir()
        for step in sorted({s["step"] for s in texts}):
            part = [s for s in texts if s["step"] == step]
            pd.DataFrame({"step": [step] * len(part), "prompt": [s["prompt"] for s in part],
                          "completion": [s["completion"] for s in part], "judge": [s["reward"] for s in part],
                          "advantage": [0.0] * len(part)}).to_parquet(
                              folder / "completions" / f"completions_{step:05d}.parquet")
    return folder


REPEATING = samples(lambda step, p: healthy_text(step, p) if step < 5 else f"{p} sum sum sum sum sum sum sum sum")
CASES = {
    "learning": (history(evals=RISING_ACCURACY), samples(healthy_text), LEARNING),
    "gaming": (history(evals={6: 0.4, 12: 0.35, 18: 0.25, 24: 0.2}), REPEATING, GAMING),
    "constant": (history(reward=lambda i: 1.0, reward_std=lambda i: 0.0, frac_reward_zero_std=lambda i: 1.0),
                 samples(healthy_text), NOT_LEARNING),
    "collapsed": (history(reward=lambda i: 0.3 + _noise(i), entropy=lambda i: max(1.0 - 0.08 * i, 0.05),
                          reward_std=lambda i: max(0.3 - 0.02 * i, 0.0)), samples(healthy_text), COLLAPSED),
    "falling": (history(reward=lambda i: 0.8 - 0.02 * i + _noise(i)), samples(healthy_text), NOT_LEARNING),
    "early": (history(n=5), (), TOO_EARLY),
}


@pytest.mark.parametrize("case", list(CASES))
def test_diagnose_gives_the_same_verdict_on_covey_and_trl_folders(tmp_path, case):
    rows, texts, verdict = CASES[case]
    covey_run = diagnose(read_run(write_covey(tmp_path / "covey", rows, texts)))
    trl_run = read_run(write_trl(tmp_path / "trl", rows, texts))
    assert trl_run.source == "trl" and len(trl_run.history) == len(rows)
    trl_verdict = diagnose(trl_run)
    assert covey_run.verdict == trl_verdict.verdict == verdict, (covey_run.text(), trl_verdict.text())
    assert [(s, f.key) for s, f in covey_run.findings] == [(s, f.key) for s, f in trl_verdict.findings]


def test_trl_names_are_read_as_covey_names():
    rows = trl_history([{"step": 2, "reward": 0.5, "rewards/judge/mean": 0.5}, {"step": 2, "eval_reward": 0.4},
                        {"step": 4, "reward": 0.6}, {"step": 4, "eval_accuracy": 0.7, "eval_rewards/judge/mean": 0.3},
                        {"step": 4, "train_runtime": 1.0}])
    assert rows == [{"step": 2, "reward": 0.5, "rewards/judge/mean": 0.5, "eval/mean_reward": 0.4},
                    {"step": 4, "reward": 0.6, "eval/accuracy": 0.7, "eval/rewards/judge/mean": 0.3,
                     "train_runtime": 1.0}]


def test_diagnose_cli_prints_the_verdict_and_writes_the_report(tmp_path, capsys):
    from covey.cli import main

    rows, texts, _ = CASES["gaming"]
    folder = write_covey(tmp_path / "run", rows, texts)
    assert main(["diagnose", str(folder), "--html"]) == 1
    out = capsys.readouterr().out
    assert "verdict: gaming the reward" in out and "step 18:" in out
    assert "Health: gaming the reward" in (folder / "report" / "report.html").read_text()
    trl = write_trl(tmp_path / "trl", *CASES["learning"][:2])
    assert main(["diagnose", str(trl), "--html", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == LEARNING
    assert "Health: learning" in (trl / "report" / "diagnosis.html").read_text()


def test_diagnose_reads_a_run_still_writing_its_last_line(tmp_path):
    rows, texts, _ = CASES["gaming"]
    folder = write_covey(tmp_path / "run", rows, texts)
    with open(folder / "metrics.jsonl", "a") as f:
        f.write('{"step": 25, "rew')
    assert diagnose(read_run(folder)).verdict == GAMING


def test_diagnose_refuses_a_folder_that_is_no_run(tmp_path):
    from covey.errors import ConfigError

    with pytest.raises(ConfigError, match="neither metrics.jsonl"):
        read_run(tmp_path)


EXPECTATIONS = json.loads((DATA / "expectations.json").read_text())  # written by hand from how each run was set up
EVALUATION_SETS = tuple(name for name in FOLDERS if name != "tuning")  # each judged after the rules were frozen for it


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.iterdir() if p.is_dir() and p.name not in EVALUATION_SETS))
def test_recorded_runs_get_their_verdicts(name):  # the tuning set; the evaluation sets: test_hacking_evaluation.py
    """Histories of real short runs (benchmarks/reward_hacking.py), kept small: each gets the verdict it was set
    up to get (tests/data/hacking/expectations.json, with why); a gamed one draws the finding its reward plants,
    an honest one draws none."""
    assert name in EXPECTATIONS, f"tests/data/hacking/{name} has no expectation in expectations.json: write one"
    expected = EXPECTATIONS[name]
    result = diagnose(read_run(DATA / name))
    assert result.verdict == expected["verdict"], result.text()
    found = {f.key for _, f in result.findings}
    if expected["verdict"] == GAMING:
        assert set(expected["planted"]) <= found, result.text()
    else:
        assert found == set(), result.text()


def test_a_long_history_is_thinned_keeping_its_ends_and_evaluations():
    rows = history(2000)
    for row in rows[500:1500:100]:
        row["eval/accuracy"] = 0.5
    kept = hacking.thin(rows)
    assert len(kept) < 300 and kept[:64] == rows[:64] and kept[-64:] == rows[-64:]
    assert sum("eval/accuracy" in r for r in kept) == 10
