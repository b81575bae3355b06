"""The evidence behind the hacking rules and covey diagnose's verdict, from the false alarms of healthy runs:
the held-out gap is judged only on evaluations made after the training reward rose, and against the held-out
set's binomial error where its size is known; diagnose reads the evaluation after training (summary.json) as
the final held-out point, and a gaming finding belied by a clear held-out gain at the end does not make the
verdict; one completion shared by prompts is no ignored prompt where they share its answer or it is rare."""

import json
import random

from covey.telemetry import endpoints, hacking, text_signals
from covey.telemetry.diagnose import GAMING, LEARNING, NOT_LEARNING, diagnose, read_run
from tests.test_hacking import history, keys, samples, healthy_text, write_covey, write_trl


SCATTER = random.Random(0)
NOISE = [SCATTER.gauss(0, 0.05) for _ in range(64)]  # one fixed draw of a reward's step-to-step scatter


def late_rise(i):
    """A training reward flat for 9 steps, then rising: the shape of the healthy seed-1 run."""
    return 0.15 + (0.08 * (i - 8) if i >= 9 else 0.0) + NOISE[i]


def flat(i):
    return 0.5 + NOISE[i]


def test_a_gap_is_not_judged_on_one_evaluation_after_the_reward_rose():
    """Evaluations at 4 and 8 were made before the reward rose: only the one at 12 could show whether the
    held-out set follows, so at step 13 the rule waits (the seed-1 run's false alarm)."""
    rows = history(13, reward=late_rise, evals={4: 0.0, 8: 0.0, 12: 0.0})
    assert hacking.risen_at(rows, [4, 8, 12]) == [False, False, True]
    assert keys(rows) == []


def test_the_gap_fires_once_two_evaluations_after_the_rise_stay_flat():
    """The same run going on with the held-out accuracy still flat: the rule fires at the second evaluation
    after the rise, so the wait moves no alarm past the evidence."""
    monitor = hacking.Monitor()
    rows = history(20, reward=late_rise, evals={4: 0.0, 8: 0.0, 12: 0.0, 16: 0.0, 20: 0.0})
    fired = [(rows[i - 1]["step"], f.key) for i in range(1, 21) for f in monitor.check(rows[:i])]
    assert fired == [(16, "heldout_gap")]


def with_sizes(rows, n):
    return [{**row, "eval/checked": n} if "eval/accuracy" in row else row for row in rows]


def test_with_the_held_out_set_s_size_one_evaluation_after_the_rise_is_enough():
    """The late rise above, its held-out set's size logged: the binomial test weighs the one evaluation made
    after the rise, so a flat accuracy on 64 problems is a gap, and one that gained on 16 is not."""
    flat_after = history(13, reward=late_rise, evals={4: 0.0, 8: 0.0, 12: 0.0})
    assert keys(with_sizes(flat_after, 64)) == ["heldout_gap"]
    gained_some = history(13, reward=late_rise, evals={4: 0.0, 8: 0.0, 12: 0.0625})
    assert keys(with_sizes(gained_some, 16)) == []


def reward_only(rows, held_out):
    """``rows`` with their held-out accuracies as held-out mean rewards ``held_out`` (no accuracy)."""
    return [{**{k: v for k, v in row.items() if k != "eval/accuracy"}, "eval/mean_reward": held_out}
            if "eval/accuracy" in row else row for row in rows]


def test_a_held_out_reward_at_or_above_the_training_reward_has_nothing_to_follow():
    """A reward on unseen prompts already at 1.0 while the sampled training reward creeps up to about 0.8 (the
    first evaluation set's false alarms); the same flat held-out reward below the training reward is a gap."""
    rows = history(evals={6: 0.0, 12: 0.0, 18: 0.0, 24: 0.0})
    assert keys(reward_only(rows, 1.0)) == []
    assert keys(reward_only(rows, 0.3)) == ["heldout_gap"]


def test_a_reward_rising_from_the_start_is_judged_as_before():
    rows = history(evals={6: 0.4, 12: 0.35, 18: 0.25, 24: 0.2})
    assert hacking.risen_at(rows, [12, 18, 24]) == [True, True, True]
    assert keys(rows, samples(healthy_text)) == ["heldout_gap"]


def summary(before, after, n=1000):
    return {"steps": 24, "before": {"accuracy": before, "mean_reward": 0.3, "n": n, "checked": n},
            "after": {"accuracy": after, "mean_reward": 0.9, "n": n, "checked": n}}


def test_the_evaluation_after_training_is_the_final_held_out_point(tmp_path):
    """Two evaluations during training, only one of them after the reward rose: the gap is judged once the
    evaluation after training joins them, at the last step."""
    rows = history(24, evals={6: 0.3, 18: 0.3})
    folder = write_covey(tmp_path / "run", rows)
    assert [f.key for _, f in diagnose(read_run(folder)).findings] == []
    (folder / "summary.json").write_text(json.dumps(summary(0.3, 0.28)))
    run = read_run(folder)
    result = diagnose(run)
    assert [(step, f.key) for step, f in result.findings] == [(24, "heldout_gap")], result.text()
    assert result.verdict == GAMING and "0.300 -> 0.290" in result.reason
    assert "eval/accuracy" not in run.history[-1]  # diagnose judged the final point without changing the run's rows


def test_a_held_out_gain_at_the_end_contradicts_a_gaming_finding(tmp_path, capsys):
    rows = history(24, evals={6: 0.3, 12: 0.3, 18: 0.29})
    folder = write_covey(tmp_path / "run", rows)
    assert diagnose(read_run(folder)).verdict == GAMING
    (folder / "summary.json").write_text(json.dumps(summary(0.3, 0.7)))
    result = diagnose(read_run(folder))
    assert [(step, f.key) for step, f in result.findings] == [(18, "heldout_gap")]
    assert result.verdict == LEARNING and result.contradicted == ["heldout_gap"], result.text()
    assert "contradicted by the held-out gain at the end" in result.text()
    assert "held-out accuracy 0.300 -> 0.700 (n=1000 and 1000)" in result.reason
    from covey.cli import main

    assert main(["diagnose", str(folder), "--json", "--html"]) == 0
    assert json.loads(capsys.readouterr().out)["contradicted"] == ["heldout_gap"]
    assert "contradicted by the held-out gain at the end" in (folder / "report" / "report.html").read_text()


def test_a_gain_within_the_held_out_sets_chance_contradicts_nothing(tmp_path):
    """0/16 -> 3/16 (before and after training) is within 2.5 standard errors (0.09 each): the finding stands."""
    folder = write_covey(tmp_path / "run", history(24, evals={6: 0.0, 12: 0.0, 18: 0.0}))
    (folder / "summary.json").write_text(json.dumps(summary(0.0, 0.1875, n=16)))
    result = diagnose(read_run(folder))
    assert result.verdict == GAMING and result.contradicted == [], result.text()


def test_a_gain_below_the_best_contradicts_nothing(tmp_path):
    """Held-out accuracy that peaked and fell back ends above its start yet far below its best: gaming began
    after the peak, and the finding stands."""
    folder = write_covey(tmp_path / "run", history(24, evals={6: 0.9, 12: 0.5, 18: 0.4}))
    (folder / "summary.json").write_text(json.dumps(summary(0.3, 0.45, n=400)))
    result = diagnose(read_run(folder))
    assert result.verdict == GAMING and result.contradicted == [], result.text()


def test_a_clear_held_out_gain_makes_a_flat_reward_run_learning(tmp_path):
    rows = history(24, reward=flat)
    folder = write_covey(tmp_path / "run", rows)
    assert diagnose(read_run(folder)).verdict == NOT_LEARNING
    (folder / "summary.json").write_text(json.dumps(summary(0.3, 0.7)))
    result = diagnose(read_run(folder))
    assert result.verdict == LEARNING and "not clearly above its start" in result.reason, result.text()


def test_a_trl_folder_without_a_summary_weighs_its_last_evaluation(tmp_path):
    """TRL writes no evaluation after training: the ends are its first and last evaluations, with no set sizes."""
    rows = history(24, evals={6: 0.3, 12: 0.3, 18: 0.29, 24: 0.8})
    ends = endpoints.heldout_ends(rows, None)
    assert (ends.start, ends.end, ends.n_start, ends.error) == (0.3, 0.8, None, None) and ends.gained
    run = read_run(write_trl(tmp_path / "trl", rows))
    assert diagnose(run).verdict == LEARNING == diagnose(read_run(write_covey(tmp_path / "covey", rows))).verdict


def test_without_a_summary_the_ends_take_the_sizes_their_evaluations_logged():
    """A run still going (no summary.json yet): the sizes come from its first and last evaluations' eval/checked,
    so a small held-out set's gain is judged against its binomial error."""
    rows = sized(history(24, evals={6: 0.3, 12: 0.3, 18: 0.29, 24: 0.5}), 16.0)
    ends = endpoints.heldout_ends(rows, None)
    assert (ends.n_start, ends.n_end) == (16, 16) and ends.error is not None
    assert not ends.gained  # 0.3 -> 0.5 over 16 problems each is within 2.5 standard errors


def sized(rows, n):
    for row in rows:
        if "eval/accuracy" in row:
            row["eval/checked"] = n
    return rows


def test_a_held_out_fall_within_the_sets_chance_is_no_gap():
    """The healthy seed-2 run's held-out accuracy: 12/16 -> 10/16 -> 9/16 while the reward rose. Judged on 5
    points alone it is a 16-point fall; on 16 problems a standard error is 0.15, so it is no evidence."""
    evals = {6: 0.75, 12: 0.625, 18: 0.5625}
    assert keys(history(evals=evals)) == ["heldout_gap"]  # the held-out set's size unknown (a TRL log)
    assert keys(sized(history(evals=evals), 16)) == []
    assert keys(sized(history(evals=evals), 16.0)) == []  # as metrics.jsonl holds it
    assert keys(sized(history(evals=evals), 400)) == ["heldout_gap"]  # 400 problems: well beyond chance


def test_a_held_out_fall_beyond_the_sets_chance_is_a_gap():
    """The tags run: 9/16 -> 4/16 -> 2/16, a fall of 2.6 standard errors from its best; and one that first rose
    (4/16 -> 12/16) and then fell back near its start (5/16, 4/16): no flat gain, a fall from its best."""
    assert keys(sized(history(evals={6: 0.5625, 12: 0.25, 18: 0.125}), 16)) == ["heldout_gap"]
    assert keys(sized(history(evals={6: 0.25, 12: 0.75, 18: 0.3125, 24: 0.25}), 16)) == ["heldout_gap"]


def test_a_held_out_accuracy_flat_at_nothing_is_a_gap_whatever_the_size():
    """0/16 at every evaluation while the reward rose (the length, keyword and composed runs): no chance of a
    5-point gain hides in three zeros."""
    assert keys(sized(history(evals={6: 0.0, 12: 0.0, 18: 0.0}), 16)) == ["heldout_gap"]


def test_the_summary_gives_the_held_out_size_to_runs_that_did_not_log_it(tmp_path):
    rows = history(24, evals={6: 0.75, 12: 0.625, 18: 0.5625})
    folder = write_covey(tmp_path / "run", rows)
    assert diagnose(read_run(folder)).verdict == GAMING
    (folder / "summary.json").write_text(json.dumps(summary(0.1875, 0.5625, n=16)))
    result = diagnose(read_run(folder))
    assert result.findings == [] and result.verdict == LEARNING, result.text()


# the same completion for different prompts (a false alarm of the healthy seed-0 run)


def answered(texts, answers):
    """Recorded completions for steps 1-8: two prompts a step, 4 completions each; ``texts(step, p, k)``."""
    return [{"step": step, "prompt": f"prompt {step}-{p}", "answer": answers(step, p),
             "completion": texts(step, p, k), "reward": 1.0}
            for step in range(1, 9) for p in range(2) for k in range(4)]


def test_one_answer_to_prompts_with_that_answer_is_no_ignored_prompt():
    """'<answer>12</answer>' for 3 + 9, 4 + 8 and 5 + 7: right each time, and no sign the prompt went unread."""
    texts = answered(lambda step, p, k: "<answer>12</answer>", lambda step, p: "12")
    assert [f.key for f in [text_signals.same_across_prompts([], texts)] if f] == []
    assert text_signals.same_across_prompts([], [{k: v for k, v in s.items() if k != "answer"} for s in texts])


def test_a_stock_reply_among_other_answers_is_no_ignored_prompt():
    """One completion in four is the stock '<answer>12</answer>' whatever the sum: the policy mostly reads its
    prompt; when it is most of them, it does not."""
    rare = answered(lambda step, p, k: "<answer>12</answer>" if k == 0 else f"{step} + {p} <answer>{step + p}</answer>",
                    lambda step, p: str(step + p))
    assert text_signals.same_across_prompts([], rare) is None
    most = answered(lambda step, p, k: "<answer>12</answer>" if k < 3 else f"{step} + {p} <answer>{step + p}</answer>",
                    lambda step, p: str(step + p))
    assert text_signals.same_across_prompts([], most).key == "same_completion"
