"""The command line, end to end, on a tiny local model folder."""

import json
import textwrap

from covey.cli import main


def test_train_from_yaml_with_overrides_and_user_rewards_then_eval(tmp_path, tiny_model_dir, capsys):
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(textwrap.dedent("""
        def distinct(completions, **kwargs):
            return [len(set(c[0]["content"])) / 8 for c in completions]
    """))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a} + 1"}], "answer": str(a + 1)}) + "\n"
                            for a in range(6)))
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""
        model: {tiny_model_dir}
        dataset: {data}
        eval_dataset: {data}
        reward_funcs: [answer_format, "{rewards}:distinct"]
        reward_weights: [1.0, 0.5]
        num_generations: 4
        per_device_train_batch_size: 8
        max_completion_length: 6
        learning_rate: 1.0e-4
        max_steps: 5
        logging_steps: 1
    """))
    run = tmp_path / "run"
    code = main(["train", str(config), "--max-steps", "2", "--learning-rate", "2e-5", "--output-dir", str(run),
                 "--eval-max-samples", "3"])
    assert code == 0
    resolved = (run / "config.yaml").read_text()
    assert "max_steps: 2" in resolved and "learning_rate: 2.0e-05" in resolved
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and "rewards/distinct/mean" in metrics[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["before"]["n"] == 3
    capsys.readouterr()

    assert main(["eval", str(run)]) == 0  # the run's own config: 3 held-out rows
    assert "n=3" in capsys.readouterr().out
    assert main(["eval", str(run), "--eval-max-samples", "5"]) == 0
    assert "n=5" in capsys.readouterr().out
    # resumed with changed settings: the config of the last resume is the one the run ended with
    for step, n in ((10, 4), (9, 2)):
        (run / f"config.resumed-at-{step}.yaml").write_text(resolved.replace("eval_max_samples: 3", f"eval_max_samples: {n}"))
    assert main(["eval", str(run)]) == 0
    assert "n=4" in capsys.readouterr().out


def test_missing_config_file_and_bad_dataset_are_one_line_errors(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--dataset", str(tmp_path / "nope.jsonl")]) == 2
    assert "dataset file" in capsys.readouterr().err


def test_unknown_command_and_usage(capsys):
    assert main(["frobnicate"]) == 2
    assert main([]) == 2
    assert "usage: covey" in capsys.readouterr().err


def test_verify_and_generate_commands(tmp_path, tiny_model_dir, capsys):
    config = tmp_path / "c.yaml"
    # a training config that resumes: sampling one batch from it resumes nothing
    config.write_text(f"model: {tiny_model_dir}\nnum_generations: 4\nmax_completion_length: 6\n"
                      "reward_funcs: [answer_format, answer_correct]\nresume_from_checkpoint: auto\n")
    code = main(["verify", str(config)])
    out = capsys.readouterr().out
    assert "covey verify" in out and "logprobs" in out
    # a random tiny model never writes tags, so answer_format is constant: a WARN, not a FAIL
    assert code == 0 and "WARN" in out and "every stage passed" in out
    out_file = tmp_path / "samples.jsonl"
    assert main(["generate", str(config), "--num-prompts", "2", "--json", str(out_file)]) == 0
    lines = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(lines) == 8 and {"prompt", "completion", "rewards", "reward", "advantage"} <= set(lines[0])
    assert abs(sum(line["advantage"] for line in lines[:4])) < 1e-4
    assert "advantage" in capsys.readouterr().out
    # the file is not replaced unless asked, and a place it cannot go is refused before anything is sampled
    assert main(["generate", str(config), "--num-prompts", "1", "--json", str(out_file)]) == 2
    assert "already exists: pass --overwrite" in capsys.readouterr().err and len(out_file.read_text().splitlines()) == 8
    assert main(["generate", str(config), "--num-prompts", "1", "--json", str(out_file), "--overwrite"]) == 0
    assert len(out_file.read_text().splitlines()) == 4
    assert main(["generate", str(config), "--json", str(tmp_path / "no" / "such.jsonl")]) == 2
    assert f"there is no folder {tmp_path / 'no'}" in capsys.readouterr().err


def test_verify_exit_code_names_the_failing_stage(tmp_path, tiny_model_dir, capsys, monkeypatch):
    import covey.core as core

    monkeypatch.setattr(core, "advantages_from_rewards",
                        lambda *a, _orig=core.advantages_from_rewards, **k: (-_orig(*a, **k)[0], _orig(*a, **k)[1]))
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {tiny_model_dir}\nnum_generations: 4\nmax_completion_length: 6\n")
    assert main(["verify", str(config), "--json", str(tmp_path / "verify.json")]) == 1
    assert "first failing stage: advantages" in capsys.readouterr().out
    data = json.loads((tmp_path / "verify.json").read_text())  # the same verdict as data, for a CI gate
    assert data["verdict"] == "FAIL" and data["exit_code"] == 1 and data["first_failing_stage"] == "advantages"
    assert any(c["stage"] == "advantages" and c["status"] == "FAIL" and c["message"] for c in data["checks"])
