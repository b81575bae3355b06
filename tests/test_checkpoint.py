"""Checkpoints and resume: a resumed run is bitwise the run that was never stopped."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file

from covey import GRPOConfig, GRPOTrainer
from covey.errors import CheckpointError, ConfigError
from covey.train import step
from covey.train.checkpoint import checkpoint_dirs, written_whole
from tests.conftest import SMALL_RUN, make_model
from tests.test_trainer import ROWS, count_a

TIMING_KEYS = ("step_time", "time/", "tokens_per_second", "async/queue_depth")  # what timing decides


def run_args(out: Path, **overrides) -> GRPOConfig:
    values = dict(output_dir=None if out is None else str(out), max_steps=6, save_steps=2, num_generations=4, per_device_train_batch_size=8,
                  max_completion_length=8, learning_rate=1e-2, eval_max_samples=0, log_completions_steps=1)
    values = {**SMALL_RUN, **values}  # what the run relies on beyond its sizes
    values.update(overrides)
    return GRPOConfig(**values)


def trainer_for(args: GRPOConfig, tokenizer, **kwargs) -> GRPOTrainer:
    return GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[count_a], args=args, train_dataset=ROWS,
                       processing_class=tokenizer, quiet=True, **kwargs)


def learned_metrics(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock timings (the only values allowed to differ)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith(TIMING_KEYS)} for m in lines]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for shard in folder.glob("*.safetensors"):
        state.update(load_file(shard))
    return state


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.mark.parametrize("variant", [
    dict(),
    dict(beta=0.04, sync_ref_model=True, ref_model_sync_steps=2, num_iterations=2, lr_scheduler_type="cosine",
         warmup_ratio=0.2, weight_decay=0.1, logging_steps=3),  # the checkpoint falls inside a logging interval
    dict(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"]),
    # run state beside the model's: the adapted coefficient and the entropy its next step's gate reads
    dict(use_adaptive_entropy=True, entropy_target=50.0, entropy_coef_delta=0.01, loss_type="sapo"),
    # the rounds sampled ahead are in the checkpoint, and trained next by the resumed run
    dict(async_generation=True),
    dict(async_generation=True, max_staleness=2),
], ids=["full", "kl-sync-ref-iterations-cosine-logging-3", "lora", "adaptive-entropy-sapo", "async-one-round-ahead",
        "async-two-rounds-ahead"])
def test_resume_from_a_checkpoint_is_bitwise_the_uninterrupted_run(tmp_path, tokenizer, variant):
    whole = trainer_for(run_args(tmp_path / "whole", save_total_limit=None, **variant), tokenizer)
    whole.train()

    # a checkpoint folder given by path continues into a new run folder (the original is left alone)
    checkpoint_2 = tmp_path / "whole" / "checkpoints" / "checkpoint-2"
    resumed = trainer_for(run_args(tmp_path / "resumed", resume_from_checkpoint=str(checkpoint_2), **variant), tokenizer)
    assert resumed.global_step == 2
    if variant.get("use_adaptive_entropy"):
        assert (resumed.progress.entropy_coef, resumed.progress.last_entropy) == pytest.approx(
            (0.02, json.loads((checkpoint_2 / "state.json").read_text())["last_entropy"]))
    resumed.train()

    assert_same_weights(tmp_path / "whole" / "final_model", tmp_path / "resumed" / "final_model")
    assert learned_metrics(tmp_path / "whole") == learned_metrics(tmp_path / "resumed")
    assert [p.name for p in checkpoint_dirs(tmp_path / "whole")] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    from transformers import AutoTokenizer  # a checkpoint's model folder is a model of its own, tokenizer included

    assert AutoTokenizer.from_pretrained(checkpoint_2 / "model").pad_token == tokenizer.covey_as_loaded[0]


def test_the_update_kernel_is_the_resuming_runs_choice_not_the_checkpoints(tmp_path, tokenizer):
    first = trainer_for(run_args(tmp_path / "first", max_steps=2), tokenizer)
    assert first.optimizer.param_groups[0]["fused"] is True  # AdamW's fused kernel on CPU
    first.train()
    # a checkpoint written by the per-tensor kernel (as on a device without the fused one)
    saved = tmp_path / "first" / "checkpoints" / "checkpoint-2" / "optimizer.json"
    state = json.loads(saved.read_text())
    for group in state["param_groups"]:
        group["fused"], group["foreach"] = None, False
    saved.write_text(json.dumps(state))
    resumed = trainer_for(run_args(tmp_path / "resumed", max_steps=4, resume_from_checkpoint=str(saved.parent)),
                          tokenizer)
    group = resumed.optimizer.param_groups[0]
    assert (group["fused"], group["foreach"]) == (True, None) and resumed.global_step == 2
    assert resumed.optimizer.state[group["params"][0]]["exp_avg"].abs().sum() > 0  # the saved moments came back
    resumed.train()


def test_a_resumed_run_updates_with_its_own_optimizer_settings(tmp_path, tokenizer):
    trainer_for(run_args(tmp_path / "first", max_steps=2), tokenizer).train()
    checkpoint = str(tmp_path / "first" / "checkpoints" / "checkpoint-2")
    changed = dict(learning_rate=5e-4, weight_decay=0.3, adam_beta1=0.5, adam_epsilon=1e-6)
    resumed = trainer_for(run_args(tmp_path / "resumed", max_steps=4, resume_from_checkpoint=checkpoint, **changed),
                          tokenizer)
    group = resumed.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"][0], group["eps"]) == (5e-4, 0.3, 0.5, 1e-6)
    resumed.train()
    assert [m["learning_rate"] for m in learned_metrics(tmp_path / "resumed")][2:] == [5e-4, 5e-4]
    assert (tmp_path / "resumed" / "config.yaml").read_text().count("learning_rate: 0.0005") == 1


def test_a_damaged_checkpoint_or_another_dataset_is_a_clear_error(tmp_path, tokenizer):
    trainer_for(run_args(tmp_path / "run", max_steps=2), tokenizer).train()
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint-2"
    (checkpoint / "optimizer.json").write_text('{"state": {"0": ')  # cut off
    with pytest.raises(CheckpointError, match="could not resume from .*checkpoint-2: JSONDecodeError.*earlier checkpoint"):
        trainer_for(run_args(tmp_path / "a", resume_from_checkpoint=str(checkpoint)), tokenizer)
    trainer_for(run_args(tmp_path / "run2", max_steps=2), tokenizer).train()
    with pytest.raises(CheckpointError, match="larger dataset than this run's 3 rows"):
        GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[count_a], train_dataset=ROWS[:3],
                    args=run_args(tmp_path / "b", resume_from_checkpoint=str(tmp_path / "run2" / "checkpoints" /
                                                                         "checkpoint-2")),
                    processing_class=tokenizer, quiet=True)


def test_a_stop_signal_in_the_last_step_lets_the_run_finish(tmp_path, tokenizer, monkeypatch):
    trainer = trainer_for(run_args(tmp_path / "run", max_steps=2, save_steps=0), tokenizer)
    optimizer_step = step.optimizer_step

    def signalled_in_the_last_step(*a, **k):
        if trainer.global_step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return optimizer_step(*a, **k)

    monkeypatch.setattr(step, "optimizer_step", signalled_in_the_last_step)
    trainer.train()
    assert (tmp_path / "run" / "final_model").is_dir() and (tmp_path / "run" / "summary.json").is_file()


def test_save_total_limit_keeps_the_newest_and_none_keeps_all(tmp_path, tokenizer):
    trainer_for(run_args(tmp_path / "a", save_total_limit=1), tokenizer).train()
    assert [p.name for p in checkpoint_dirs(tmp_path / "a")] == ["checkpoint-6"]
    trainer_for(run_args(tmp_path / "b", save_total_limit=None), tokenizer).train()
    assert [p.name for p in checkpoint_dirs(tmp_path / "b")] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    ckpt = tmp_path / "b" / "checkpoints" / "checkpoint-2"
    assert {"model", "optimizer.safetensors", "optimizer.json", "rng.safetensors", "state.json"} <= {
        p.name for p in ckpt.iterdir()}
    state = json.loads((ckpt / "state.json").read_text())
    assert state["global_step"] == 2 and len(state["history"]) == 2 and "sampler" in state and "rng" in state
    assert not list(ckpt.rglob("*.bin")) and not list(ckpt.rglob("*.pt"))  # nothing pickled


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   PermissionError(errno.EACCES, "Permission denied"),
                                   SafetensorError("I/O error: No space left on device (os error 28)")],
                         ids=["disk-full", "permission", "disk-full-in-safetensors"])
def test_a_failed_write_leaves_the_previous_checkpoint_whole(tmp_path, tokenizer, monkeypatch, error):
    import covey.train.checkpoint as checkpoint

    real_save_file, calls = checkpoint.save_file, []

    def failing_on_the_second_checkpoint(tensors, path, *a, **k):
        calls.append(path)
        if "checkpoint-4" in str(path):
            raise error
        return real_save_file(tensors, path, *a, **k)

    monkeypatch.setattr(checkpoint, "save_file", failing_on_the_second_checkpoint)
    with pytest.raises(CheckpointError, match="No space left on device|Permission denied"):
        trainer_for(run_args(tmp_path / "run"), tokenizer).train()
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["checkpoint-2"]
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]
    monkeypatch.setattr(checkpoint, "save_file", real_save_file)
    resumed = trainer_for(run_args(tmp_path / "run", resume_from_checkpoint="auto"), tokenizer)
    assert resumed.global_step == 2


def test_resuming_an_older_checkpoint_never_mixes_histories_or_prunes_the_new_one(tmp_path, tokenizer):
    trainer_for(run_args(tmp_path / "run", save_total_limit=None), tokenizer).train()  # checkpoints 2, 4, 6
    checkpoint_2 = str(tmp_path / "run" / "checkpoints" / "checkpoint-2")
    with pytest.raises(ConfigError, match="holds checkpoints after checkpoint-2 .checkpoint-4, checkpoint-6.*new --output-dir"):
        trainer_for(run_args(tmp_path / "run", resume_from_checkpoint=checkpoint_2), tokenizer)
    with pytest.raises(ConfigError, match="already holds files"):  # another run's folder is not written into
        trainer_for(run_args(tmp_path / "run", resume_from_checkpoint=checkpoint_2, output_dir=str(tmp_path / "run" / "checkpoints")), tokenizer)
    branch = trainer_for(run_args(tmp_path / "branch", resume_from_checkpoint=checkpoint_2, max_steps=4,
                                  save_total_limit=1), tokenizer)
    branch.train()
    assert [p.name for p in checkpoint_dirs(tmp_path / "branch")] == ["checkpoint-4"]
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not (tmp_path / "branch" / "config.resumed-at-2.yaml").exists()  # only how to continue differed


def test_a_checkpoint_path_alone_continues_its_own_run_despite_a_cut_off_log(tmp_path, tokenizer):
    trainer_for(run_args(tmp_path / "run", max_steps=4), tokenizer).train()
    completions = tmp_path / "run" / "completions.jsonl"
    completions.write_text(completions.read_text() + '{"step": 5, "prompt": "cut of')  # a crash mid-line
    last = tmp_path / "run" / "checkpoints" / "checkpoint-4"
    resumed = trainer_for(run_args(None, output_dir=None, resume_from_checkpoint=str(last)), tokenizer)
    assert resumed.run_dir == (tmp_path / "run").resolve()
    resumed.train()
    steps = [json.loads(line)["step"] for line in completions.read_text().splitlines()]
    assert sorted(set(steps)) == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "run" / "config.resumed-at-4.yaml").exists()  # max_steps changed from 4 to 6


def test_auto_resume_finds_a_relative_output_dir(tmp_path, tokenizer, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer_for(run_args(Path("runs/long"), max_steps=2), tokenizer).train()
    resumed = trainer_for(run_args(Path("runs/long"), max_steps=4, resume_from_checkpoint="auto"), tokenizer)
    assert resumed.run.resume_from == (tmp_path / "runs/long/checkpoints/checkpoint-2")
    resumed.train()
    assert [m["step"] for m in learned_metrics(tmp_path / "runs/long")] == [1, 2, 3, 4]


def test_a_checkpoint_outside_a_run_folder_needs_an_output_dir(tmp_path, tokenizer):
    trainer_for(run_args(tmp_path / "run", max_steps=2), tokenizer).train()
    loose = tmp_path / "home" / "my-checkpoint"
    loose.parent.mkdir()
    (tmp_path / "run" / "checkpoints" / "checkpoint-2").rename(loose)
    (tmp_path / "home" / "summary.json").write_text("the user's own")
    with pytest.raises(ConfigError, match="does not lie in the checkpoints/ folder of a run.*give --output-dir"):
        GRPOTrainer(args=run_args(None, resume_from_checkpoint=str(loose)), reward_funcs=[count_a],
                    train_dataset=ROWS, model="no/such-model-is-loaded")
    assert (tmp_path / "home" / "summary.json").read_text() == "the user's own"
    branch = trainer_for(run_args(tmp_path / "branch", max_steps=3, resume_from_checkpoint=str(loose)), tokenizer)
    branch.train()
    assert [m["step"] for m in learned_metrics(tmp_path / "branch")] == [1, 2, 3]  # the history comes along


def test_overwrite_output_dir_clears_the_previous_runs_outputs_and_nothing_else(tmp_path, tokenizer):
    trainer_for(run_args(tmp_path / "run", max_steps=4), tokenizer).train()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    trainer_for(run_args(tmp_path / "run", max_steps=2, overwrite_output_dir=True), tokenizer).train()
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["checkpoint-2"]
    assert [m["step"] for m in learned_metrics(tmp_path / "run")] == [1, 2]
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_resuming_from_beyond_max_steps_is_refused(tmp_path, tokenizer):
    trainer_for(run_args(tmp_path / "run", max_steps=4), tokenizer).train()
    loose = tmp_path / "copied"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "checkpoint-4", loose)
    for where in ("auto", str(loose)):
        with pytest.raises(ConfigError, match="is at step 4, beyond max_steps=3: raise max_steps"):
            trainer_for(run_args(tmp_path / "run", max_steps=3, resume_from_checkpoint=where), tokenizer)
    # a checkpoint folder of any name is placed by the step it holds
    shutil.copytree(tmp_path / "run" / "checkpoints" / "checkpoint-2", tmp_path / "my-copy")
    with pytest.raises(ConfigError, match="holds checkpoints after my-copy .checkpoint-4."):
        trainer_for(run_args(tmp_path / "run", max_steps=6, overwrite_output_dir=True,
                             resume_from_checkpoint=str(tmp_path / "my-copy")), tokenizer)


def test_overwrite_output_dir_never_replaces_a_config_the_user_wrote(tmp_path, tokenizer):
    folder = tmp_path / "experiment"
    folder.mkdir()
    mine = "# my experiment\nlearning_rate: 1.0e-5\n"
    (folder / "config.yaml").write_text(mine)
    with pytest.raises(ConfigError, match="was not saved by a covey run"):
        trainer_for(run_args(folder, max_steps=1, overwrite_output_dir=True), tokenizer)
    assert (folder / "config.yaml").read_text() == mine
    # nor one written with GRPOConfig.save, every field and all
    GRPOConfig(learning_rate=1e-5).save(folder / "config.yaml")
    with pytest.raises(ConfigError, match="was not saved by a covey run"):
        trainer_for(run_args(folder, max_steps=1, overwrite_output_dir=True), tokenizer)
    # a run's config from before runs marked theirs, beside the run's outputs: that run's, cleared
    (folder / "tensorboard").mkdir()  # an older run stopped before it logged a step: its trackers' folder only
    trainer_for(run_args(folder, max_steps=1, overwrite_output_dir=True), tokenizer).train()
    assert GRPOConfig.from_yaml(folder / "config.yaml").max_steps == 1
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        trainer_for(run_args(tmp_path / "a_file", max_steps=1), tokenizer)


def test_two_runs_set_up_at_once_never_share_a_folder(tmp_path, tokenizer, monkeypatch):
    import covey.train.run_folder

    monkeypatch.chdir(tmp_path)
    moment = covey.train.run_folder.datetime(2026, 1, 2, 3, 4, 5)
    monkeypatch.setattr(covey.train.run_folder, "datetime", type("Frozen", (), {"now": staticmethod(lambda: moment)}))
    first, second = (trainer_for(run_args(None, max_steps=1, save_steps=0), tokenizer) for _ in range(2))
    assert first.run_dir == second.run_dir  # set up in the same second: the same name so far
    first.train()
    second.train()
    assert first.run_dir != second.run_dir and second.run_dir.name == "20260102-030405-2"
    assert all((run / "final_model").is_dir() for run in (first.run_dir, second.run_dir))
    # an output_dir another run began writing in after this one was set up
    a, b = (trainer_for(run_args(tmp_path / "shared", max_steps=1, save_steps=0), tokenizer) for _ in range(2))
    a.train()
    with pytest.raises(ConfigError, match="was taken by another run after this one was set up"):
        b.train()


def test_logged_metrics_are_the_means_over_each_logging_interval(tmp_path, tokenizer):
    settings = dict(max_steps=4, save_steps=0, lr_scheduler_type="cosine", beta=0.04)
    trainer_for(run_args(tmp_path / "every", **settings), tokenizer).train()
    trainer_for(run_args(tmp_path / "pairs", logging_steps=2, **settings), tokenizer).train()
    every, pairs = learned_metrics(tmp_path / "every"), learned_metrics(tmp_path / "pairs")
    assert [m["step"] for m in pairs] == [2, 4]
    for logged, first, second in ((pairs[0], every[0], every[1]), (pairs[1], every[2], every[3])):
        for key in ("loss", "reward", "kl", "entropy", "completions/mean_length", "grad_norm"):
            assert logged[key] == pytest.approx((first[key] + second[key]) / 2, rel=1e-6), key
        assert logged["learning_rate"] == second["learning_rate"] != first["learning_rate"]  # as of the step


def test_resume_errors_are_clear_and_come_before_the_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="found no checkpoint"):
        GRPOTrainer(args=run_args(tmp_path / "empty", resume_from_checkpoint="auto"), reward_funcs=[count_a],
                    train_dataset=ROWS, model="no/such-model-is-loaded")
    with pytest.raises(ConfigError, match="is not a checkpoint folder"):
        GRPOTrainer(args=run_args(tmp_path / "x", resume_from_checkpoint=str(tmp_path)), reward_funcs=[count_a],
                    train_dataset=ROWS, model="no/such-model-is-loaded")


# ---- the real thing: a training process killed with SIGKILL, and one stopped with SIGTERM ------------------


@pytest.fixture
def cli_run(tmp_path, tiny_model_dir):
    """A config for `covey train` on the tiny model, and a way to start it as a subprocess."""
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "rewards.py").write_text(
        "def count_a(completions, **kw):\n"
        "    texts = [c[0]['content'] if isinstance(c, list) else c for c in completions]\n"
        "    return [(len(set(t)) + t.count('a')) / 8 for t in texts]\n")
    config = {**SMALL_RUN, "model": str(tiny_model_dir), "dataset": str(tmp_path / "data.jsonl"), "eval_max_samples": 0,
              "reward_funcs": [f"{tmp_path / 'rewards.py'}:count_a"], "max_steps": 16, "save_steps": 2,
              "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 8,
              "learning_rate": 0.01, "save_total_limit": None}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def start(out: Path, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "covey.cli", "train", str(tmp_path / "config.yaml"),
                                 "--output-dir", str(out), *extra], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return start


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    _, err = process.communicate(timeout=timeout)
    return process.returncode, err


def test_sigkill_after_a_checkpoint_then_resume_equals_the_uninterrupted_run(tmp_path, cli_run):
    code, err = finish(cli_run(tmp_path / "whole"))
    assert code == 0, err

    victim = cli_run(tmp_path / "killed")
    wait_for(tmp_path / "killed" / "checkpoints" / "checkpoint-4", victim)
    victim.send_signal(signal.SIGKILL)
    finish(victim)
    assert victim.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "final_model").exists()  # it really died mid-run

    code, err = finish(cli_run(tmp_path / "killed", "--resume-from-checkpoint", "auto"))
    assert code == 0, err
    assert_same_weights(tmp_path / "whole" / "final_model", tmp_path / "killed" / "final_model")
    assert learned_metrics(tmp_path / "whole") == learned_metrics(tmp_path / "killed")


def test_sigterm_saves_a_checkpoint_and_says_how_to_resume(tmp_path, cli_run):
    process = cli_run(tmp_path / "run")
    wait_for(tmp_path / "run" / "metrics.jsonl", process)
    process.send_signal(signal.SIGTERM)
    code, err = finish(process)
    assert code == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "--resume-from-checkpoint auto" in err and "Traceback" not in err
    saved = checkpoint_dirs(tmp_path / "run")
    assert saved, "no checkpoint was written on SIGTERM"
    stopped_at = int(saved[-1].name.split("-")[1])
    assert stopped_at < 16
    code, err = finish(cli_run(tmp_path / "run", "--resume-from-checkpoint", "auto"))
    assert code == 0, err
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, 17))


def test_a_resume_back_to_earlier_settings_is_recorded(tmp_path, tokenizer):
    """The saved configs say which settings held from which step: a resume that changes them back is one more."""
    from covey.telemetry.runlog import resumed_configs
    from covey.train.run_folder import write_run_config
    from covey.train.run_outputs import save_config

    trainer = trainer_for(run_args(tmp_path / "run", max_steps=6), tokenizer)
    trainer.run_dir.mkdir(parents=True)
    first = dict(trainer.run.config_as_used)
    write_run_config(trainer.run_dir / "config.yaml", first)
    write_run_config(trainer.run_dir / "config.resumed-at-2.yaml", {**first, "learning_rate": 0.5})
    save_config(trainer.run_dir, first, True, 4)  # resumed at step 4 with the first settings again
    assert [step for step, _ in resumed_configs(trainer.run_dir)] == [2, 4]


def test_a_final_model_that_cannot_be_written_leaves_a_checkpoint_to_finish_from(tmp_path, tokenizer, monkeypatch):
    from transformers import PreTrainedModel

    real = PreTrainedModel.save_pretrained

    def disk_full_for_the_final_model(self, folder, *args, **kwargs):
        if Path(folder).name.startswith(".tmp-final_model"):
            real(self, folder, *args, **kwargs)  # half of it written, then the disk is full
            raise OSError(28, "No space left on device")
        return real(self, folder, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", disk_full_for_the_final_model)
    with pytest.raises(CheckpointError, match=r"could not write the final model .*No space left on device .*"
                                              r"the trained weights are in .*checkpoint-3"):
        trainer_for(run_args(tmp_path / "run", max_steps=3, save_steps=0), tokenizer).train()
    assert not (tmp_path / "run" / "final_model").exists() and not list((tmp_path / "run").glob(".tmp-*"))
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)
    (tmp_path / "run" / ".tmp-final_model-1").mkdir()  # as a save killed by a second Ctrl-C leaves it
    trainer_for(run_args(tmp_path / "run", max_steps=3, save_steps=0, resume_from_checkpoint="auto"), tokenizer).train()
    assert (tmp_path / "run" / "final_model" / "model.safetensors").is_file()
    assert not list((tmp_path / "run").glob(".tmp-*"))


def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path):
    final = tmp_path / "final_model"
    final.mkdir()
    (final / "weights").write_text("old")
    with pytest.raises(OSError, match="No space"):
        with written_whole(final, "final_model-*") as tmp:
            (tmp / "weights").write_text("half")
            raise OSError(28, "No space left on device")
    assert (final / "weights").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["final_model"]
    with written_whole(final, "final_model-*") as tmp:
        (tmp / "weights").write_text("new")
    assert (final / "weights").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["final_model"]


def test_a_writer_killed_while_replacing_leaves_a_whole_folder_behind(tmp_path):
    # killed between moving the old folder aside and renaming the new one in: the old one is put back
    aside = tmp_path / ".old-checkpoint-4-123"
    aside.mkdir()
    (aside / "state.json").write_text("{}")
    (tmp_path / ".tmp-checkpoint-4-123").mkdir()
    # killed after the new one was in place, before the old one was deleted: the old one goes
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / ".old-checkpoint-2-77").mkdir()
    with written_whole(tmp_path / "checkpoint-6", "checkpoint-*") as tmp:
        (tmp / "state.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert (tmp_path / "checkpoint-4" / "state.json").is_file()


def test_a_folder_whose_replacement_fails_to_move_in_keeps_the_old_one(tmp_path, monkeypatch):
    final = tmp_path / "final_model"
    final.mkdir()
    (final / "weights").write_text("old")
    rename = Path.rename

    def failing_for_the_new_folder(self, target):
        if self.name.startswith(".tmp-"):
            raise OSError(5, "Input/output error")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_for_the_new_folder)
    with pytest.raises(OSError, match="Input/output"):
        with written_whole(final, "final_model-*") as tmp:
            (tmp / "weights").write_text("new")
    assert (final / "weights").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["final_model"]


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_saved_weights_are_as_readable_as_the_other_files_the_umask_allows(tmp_path, tokenizer):
    old = os.umask(0o027)
    try:
        trainer_for(run_args(tmp_path / "run", max_steps=1, save_steps=1), tokenizer).train()
    finally:
        os.umask(old)
    run = tmp_path / "run"
    for folder in (run / "final_model", run / "checkpoints" / "checkpoint-1"):
        weights = list(folder.rglob("*.safetensors"))
        assert weights, folder
        for path in weights:  # not the 0o600 safetensors writes its files with
            assert path.stat().st_mode & 0o777 == 0o640 == (run / "config.yaml").stat().st_mode & 0o777, path


def test_the_signal_handler_says_what_it_does_without_the_console(tmp_path, capfd):
    """The handler runs wherever the main thread was, a print through the console (and the imports it makes
    on first use) included: it says what it does straight to standard error and records the stop."""

    from covey.telemetry.runlog import RunLog
    from covey.train.between_steps import stop_on_signals

    class PrintingWhenSignalled:
        def print(self, *args, **kwargs):
            raise AssertionError("the signal handler printed through the console")

    log = RunLog(tmp_path, 4)
    log.console = PrintingWhenSignalled()
    with stop_on_signals(log, 1) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs in this thread, between two bytecodes
    assert stop.signal == signal.SIGTERM
    assert "SIGTERM received: saving a checkpoint after this step" in capfd.readouterr().err
