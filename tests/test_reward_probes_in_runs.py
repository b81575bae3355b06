"""Where the reward probes show: covey verify's probes stage (a finding fails it unless accepted), the
warnings and reward_probes.json before covey train's first step, the run report; and covey diagnose on a
run folder that TRL's own GRPOTrainer wrote."""

import json
import shutil
import warnings
from pathlib import Path

import pytest

from covey import GRPOConfig, GRPOTrainer
from covey.rewards import answer_correct
from covey.telemetry.diagnose import GAMING, diagnose, read_run
from covey.telemetry.report import write_report
from covey.verify import verify
from covey.verify.report import exit_code
from tests.conftest import SMALL_RUN, make_model
from tests.test_reward_probes import ARITHMETIC, any_number_matches

ROWS = ARITHMETIC[:24]
TRL_RUN = Path(__file__).parent / "data" / "trl-run"  # kept apart from data/hacking: its verdict is written here


def settings(tmp_path, **changes):
    return GRPOConfig(**{**SMALL_RUN, **dict(output_dir=str(tmp_path / "run"), max_steps=1, num_generations=4,
                                per_device_train_batch_size=4, max_completion_length=24, learning_rate=1e-3,
                                logging_steps=1, eval_max_samples=0, seed=3), **changes})


def test_covey_verify_fails_the_probes_stage_on_a_hackable_reward_unless_accepted(tmp_path, tokenizer):
    def run(accepted=()):
        return verify(settings(tmp_path), num_prompts=2, model=make_model(len(tokenizer), seed=5),
                      processing_class=tokenizer, train_dataset=ROWS, reward_funcs=[any_number_matches, answer_correct],
                      probes=True, accepted_probes=accepted)

    report = run()
    failed = [c for c in report.checks if c.status == "FAIL"]
    assert report.first_failure == "probes" and exit_code(report) == 1, [(c.stage, c.name) for c in failed]
    assert {c.name for c in failed} >= {"any_number_matches against candidates"}
    assert all(c.name.startswith("any_number_matches") for c in failed)
    assert "--accept-probe any_number_matches:candidates" in failed[0].hint
    passed = [c.name for c in report.checks if c.stage == "probes" and c.status == "PASS"]
    assert passed == ["answer_correct is not fooled by a probe"]

    report = run(accepted=("any_number_matches",))
    probes = [c for c in report.checks if c.stage == "probes"]
    assert report.first_failure is None and exit_code(report) == 0
    assert {c.status for c in probes if c.name.startswith("any_number_matches")} == {"WARN"}


def test_covey_verify_without_probes_has_no_probes_stage(tmp_path, tokenizer):
    report = verify(settings(tmp_path), num_prompts=2, model=make_model(len(tokenizer), seed=5),
                    processing_class=tokenizer, train_dataset=ROWS, reward_funcs=[any_number_matches])
    assert not [c for c in report.checks if c.stage == "probes"]


def test_covey_train_warns_of_a_hackable_reward_before_its_first_step_and_trains(tmp_path, tokenizer):
    with pytest.warns(UserWarning, match=r"reward probe: reward 'any_number_matches' is fooled by .*training goes on"):
        trainer = GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[any_number_matches, answer_correct],
                              args=settings(tmp_path), train_dataset=ROWS, processing_class=tokenizer, quiet=True)
    assert trainer.global_step == 0  # warned before the first step
    trainer.train()
    run = tmp_path / "run"
    found = json.loads((run / "reward_probes.json").read_text())
    assert found["rows"] == 2 and {f["reward"] for f in found["findings"]} == {"any_number_matches"}
    assert found["scores"]["answer_correct"]["yardstick"] == 1.0
    page = write_report(run).read_text()
    assert "<h2>Reward probes</h2>" in page and "any_number_matches" in page.split("<h2>Reward probes</h2>")[1]


def test_reward_probes_off_probe_nothing(tmp_path, tokenizer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[any_number_matches], processing_class=tokenizer,
                    args=settings(tmp_path, reward_probes=False), train_dataset=ROWS, quiet=True)
    assert not [w for w in caught if "reward probe" in str(w.message)]
    assert not (tmp_path / "run" / "reward_probes.json").exists()


def test_the_findings_go_to_the_run_folder_and_the_report_section(tmp_path):
    from covey import probe_rewards
    from covey.telemetry.probe_findings import probes_html
    from covey.train.reward_probing import write_probe_findings

    assert probes_html(tmp_path) == ""  # a run that did not probe: no section
    write_probe_findings(tmp_path, None)
    assert not list(tmp_path.iterdir())
    report = probe_rewards([any_number_matches, answer_correct], ROWS, num_rows=2, max_completion_length=64)
    write_probe_findings(tmp_path, report)
    assert json.loads((tmp_path / "reward_probes.json").read_text()) == json.loads(json.dumps(report.as_dict()))
    section = probes_html(tmp_path)
    assert f"{len(report.findings)} finding(s) before the first step" in section
    assert "&lt;answer&gt;11, 13, 12, 14, 10&lt;/answer&gt;" in section  # the example, escaped
    (tmp_path / "reward_probes.json").write_text("{")
    assert "could not be read" in probes_html(tmp_path)


def test_covey_diagnose_reads_a_run_trl_s_own_trainer_wrote(tmp_path):
    """benchmarks/trl_run_fixture.py: a tiny random model, a reward paying for length alone and an honest sum
    check. The policy can only learn to stop ending early, so the reward rises on length: gaming, by the
    rule that the reward follows the length; the honest reward gives it nothing to stand on."""
    run = read_run(TRL_RUN)
    assert run.source == "trl" and len(run.history) >= 20 and run.samples
    assert {"rewards/length_bonus/mean", "rewards/sum_correct/mean"} <= set(run.history[0])
    diagnosis = diagnose(run)
    assert diagnosis.verdict == GAMING, diagnosis.text()
    assert "the reward pays for length" in diagnosis.text()
    # the same folder read after a copy, without its completions: the verdict rests on the metrics too
    shutil.copytree(TRL_RUN, tmp_path / "run", ignore=shutil.ignore_patterns("completions"))
    assert diagnose(read_run(tmp_path / "run")).verdict == GAMING


def test_covey_verify_takes_accept_probe_before_or_after_the_json_option(capsys, tmp_path):
    from covey.cli import _parse_command, _verify_output_options, main

    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    assert "--accept-probe NAME" in capsys.readouterr().out
    output, rest = _verify_output_options(["--accept-probe", "judge:length", "--json", str(tmp_path / "v.json"),
                                           "--accept-probe", "counts_tags"])
    namespace, _ = _parse_command("covey verify", "", rest, probes=True)
    assert output.json == str(tmp_path / "v.json")
    assert namespace.accept_probe == ["judge:length", "counts_tags"]


def test_covey_verify_probes_a_reward_per_tool_call_with_the_run_s_tools_and_weights(tmp_path, tokenizer):
    from covey.agents import calculate
    from covey.rewards.builtin import tool_use
    from tests.test_reward_probes import calls_paid

    def probes(funcs, weights=None, accepted=(), status="FAIL"):
        report = verify(settings(tmp_path, max_tool_calling_iterations=1, reward_weights=weights, max_prompt_length=1024),
                        num_prompts=2, model=make_model(len(tokenizer), seed=5), processing_class=tokenizer,
                        train_dataset=ROWS, reward_funcs=funcs, tools=[calculate], probes=True, accepted_probes=accepted)
        return {c.name for c in report.checks if c.stage == "probes" and c.status == status}

    assert probes([calls_paid]) == {"calls_paid against tool_call_no_answer"}
    assert probes([answer_correct, tool_use], [2.0, 0.5]) == set()  # examples/multiplication_tool.yaml's
    found = "answer_correct+tool_use against tool_call_no_answer"  # at equal weights a call pays as much as the answer
    assert probes([answer_correct, tool_use]) == {found}
    assert probes([answer_correct, tool_use], accepted=["answer_correct+tool_use:tool_call_no_answer"],
                  status="WARN") == {found}  # accepted, and the name known
