"""What a TRL user's script expects of the trainer's lifecycle: transformers' callbacks, push_to_hub,
save_strategy (steps, epoch, no) and save_only_model. Tiny random Llama, a few steps per run; the
Hub is a fake that records what would be uploaded."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import PrinterCallback, TrainerCallback, TrainerControl, TrainerState

from covey import GRPOConfig, GRPOTrainer
from covey.errors import ConfigError, HubError
from covey.train.callbacks import EVENTS
from covey.train.checkpoint import checkpoint_dirs, step_of
from tests.conftest import make_model, make_tokenizer
from tests.test_distributed import as_launched, free_port, run_in_two_processes
from tests.test_trainer import ROWS, count_a, small_args


def trainer_for(args: GRPOConfig, tokenizer, **kwargs) -> GRPOTrainer:
    return GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[count_a], args=args, train_dataset=ROWS,
                       processing_class=tokenizer, quiet=True, **kwargs)


def logged_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


class Recorder(TrainerCallback):
    """Every event with the step the state says, and (for its first call) what came with it."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.seen: dict[str, dict] = {}

    def record(self, event, args, state, control, **kwargs):
        assert isinstance(state, TrainerState) and isinstance(control, TrainerControl)
        self.calls.append((event, state.global_step))
        self.seen.setdefault(event, {"kwargs": kwargs, "epoch": state.epoch, "output_dir": args.output_dir})


for _event in EVENTS:
    setattr(Recorder, _event, lambda self, *a, _event=_event, **k: self.record(_event, *a, **k))


# ---- callbacks --------------------------------------------------------------------------------


def test_callbacks_get_every_event_in_transformers_order_with_its_state(tmp_path, tokenizer, capsys):
    """Two optimizer steps per generation round (steps_per_generation): on_step_begin/on_step_end around
    each, the first begin before the round samples; on_log with TRL's metric names after the round."""
    recorder = Recorder()
    args = small_args(tmp_path, max_steps=3, steps_per_generation=4, gradient_accumulation_steps=2, logging_steps=1)
    trainer = trainer_for(args, tokenizer, eval_dataset=ROWS[:2], callbacks=[recorder, PrinterCallback])
    assert [type(c) for c in trainer.callback_handler.callbacks] == [Recorder, PrinterCallback]  # a class is made
    trainer.train()
    assert recorder.calls == [
        ("on_init_end", 0), ("on_train_begin", 0), ("on_evaluate", 0),
        ("on_step_begin", 0), ("on_step_end", 1), ("on_step_begin", 1), ("on_step_end", 2),
        ("on_log", 1), ("on_log", 2),
        ("on_step_begin", 2), ("on_step_end", 3), ("on_log", 3),
        ("on_evaluate", 3), ("on_log", 3), ("on_train_end", 3)]  # the closing log entry, as transformers
    log = recorder.seen["on_log"]["kwargs"]["logs"]
    assert {"loss", "reward", "reward_std", "grad_norm", "learning_rate", "epoch"} <= set(log)
    assert log["epoch"] == recorder.seen["on_log"]["epoch"] == 0.5  # 4 of the 8 prompts drawn
    assert recorder.seen["on_evaluate"]["kwargs"]["metrics"].keys() == {"eval_accuracy", "eval_mean_reward", "eval_n"}
    step_kwargs = recorder.seen["on_step_end"]["kwargs"]
    assert step_kwargs["model"] is trainer.model and step_kwargs["optimizer"] is trainer.optimizer
    assert step_kwargs["processing_class"] is tokenizer and step_kwargs["lr_scheduler"] is trainer.scheduler
    assert recorder.seen["on_train_begin"]["output_dir"] == str(tmp_path / "run")
    state = trainer.state
    assert (state.global_step, state.max_steps, state.logging_steps, state.num_train_epochs) == (3, 3, 1, 1)
    assert [entry["step"] for entry in state.log_history] == [1, 2, 3, 3]  # the last: train() closing
    assert "train_loss" in state.log_history[-1] and "train_loss" not in state.log_history[-2]
    assert state.log_history[0]["loss"] == json.loads((tmp_path / "run" / "metrics.jsonl").read_text()
                                                      .splitlines()[0])["loss"]
    printed = capsys.readouterr().out.splitlines()  # transformers' PrinterCallback, unchanged
    assert len(printed) == 4 and all("'reward'" in line and "'epoch'" in line for line in printed)
    assert "'train_loss'" in printed[-1]  # the closing entry, printed as transformers prints it


def test_a_run_no_callback_reads_holds_its_metrics_once_and_makes_log_history_when_asked(tmp_path, tokenizer):
    """Without callbacks the logged metrics live in the trainer's history only (a long run held them
    twice); log_history made from it afterwards is the one a run with a callback builds as it goes."""
    def log_history_of(run: str, callbacks: list) -> tuple[list[dict], list]:
        trainer = trainer_for(small_args(tmp_path / run, max_steps=3, logging_steps=1), tokenizer, callbacks=callbacks)
        handler, held = trainer.callback_handler, []
        log_training = handler.log_training
        handler.log_training = lambda step, metrics: (log_training(step, metrics), held.append(handler._log_history))
        trainer.train()
        timing = ("time/", "step_time", "_per_second", "runtime")
        return [{k: v for k, v in entry.items() if not any(t in k for t in timing)}
                for entry in trainer.state.log_history], held

    made, held = log_history_of("alone", [])
    assert held == [None, None, None]  # three steps logged, no second copy of their metrics
    kept, _ = log_history_of("with_callback", [Recorder()])
    assert [entry["step"] for entry in made] == [1, 2, 3, 3] and all("epoch" in entry for entry in made)
    assert made == kept


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step, self.ended = step, False

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.ended = True


def test_a_callback_stops_the_training_after_the_step_as_a_normal_end(tmp_path, tokenizer):
    stopper = StopAt(2)
    trainer = trainer_for(small_args(tmp_path, max_steps=6, logging_steps=5), tokenizer, callbacks=[stopper])
    trainer.train()
    summary = trainer.summary
    run = tmp_path / "run"
    assert summary["steps"] == trainer.global_step == 2 and stopper.ended
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert (run / "final_model" / "model.safetensors").is_file() and (run / "final_model" / "README.md").is_file()
    assert logged_steps(run) == [2]  # the stopping step's metrics are written, whatever logging_steps says


def test_a_stop_inside_a_round_skips_its_remaining_optimizer_steps(tmp_path, tokenizer):
    args = small_args(tmp_path, max_steps=4, steps_per_generation=4, gradient_accumulation_steps=2)
    trainer = trainer_for(args, tokenizer, callbacks=[StopAt(1)])
    assert trainer.train().global_step == 1 and logged_steps(tmp_path / "run") == [1]


class Asking(TrainerCallback):
    """Asks for a checkpoint after step 1 and for a log line at step 3 (through on_step_end), and for a
    checkpoint from on_log at step 4 (as a callback that saves on a good metric would)."""

    def __init__(self):
        self.saved_at = []

    def on_step_end(self, args, state, control, **kwargs):
        control.should_save = state.global_step == 1
        control.should_log = state.global_step == 3

    def on_log(self, args, state, control, logs=None, **kwargs):
        control.should_save = state.global_step == 4

    def on_save(self, args, state, control, **kwargs):
        self.saved_at.append(state.global_step)


def test_checkpoints_and_logs_a_callback_asks_for_are_written(tmp_path, tokenizer):
    asking = Asking()
    args = small_args(tmp_path, max_steps=5, save_strategy="no", logging_steps=4, save_total_limit=None)
    trainer_for(args, tokenizer, callbacks=[asking]).train()
    run = tmp_path / "run"
    assert [step_of(p) for p in checkpoint_dirs(run)] == asking.saved_at == [1, 4]
    assert logged_steps(run) == [3, 4, 5]


class StopWhenHeldOutRewardStalls(TrainerCallback):
    """Early stopping as users write it: on the held-out metrics of each evaluation."""

    def __init__(self):
        self.best, self.evaluated_at = None, []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluated_at.append(state.global_step)
        if self.best is not None and metrics["eval_mean_reward"] <= self.best:
            control.should_training_stop = True
        self.best = max(self.best or 0.0, metrics["eval_mean_reward"])


def test_early_stopping_on_held_out_metrics(tmp_path, tokenizer):
    stopping = StopWhenHeldOutRewardStalls()
    args = small_args(tmp_path, max_steps=12, eval_strategy="steps", eval_steps=1)
    trainer = trainer_for(args, tokenizer, eval_dataset=ROWS[:2], callbacks=[stopping])
    trainer.train()
    assert trainer.global_step < 12 and stopping.evaluated_at[-2] == trainer.global_step  # stopped after an evaluation
    assert stopping.evaluated_at[-1] == trainer.global_step  # and the evaluation after training, as always


def test_callbacks_are_added_popped_and_removed_as_in_transformers(tmp_path, tokenizer):
    trainer = trainer_for(small_args(tmp_path, max_steps=1), tokenizer, callbacks=[PrinterCallback])
    recorder = Recorder()
    trainer.add_callback(recorder)
    trainer.add_callback(StopAt(5))
    assert isinstance(trainer.pop_callback(PrinterCallback), PrinterCallback)
    assert trainer.pop_callback(PrinterCallback) is None
    trainer.remove_callback(StopAt)
    trainer.remove_callback(PrinterCallback)  # a class there is none of: nothing to do
    with pytest.raises(ValueError, match="not one of the trainer's callbacks"):
        trainer.remove_callback(StopAt(1))
    assert trainer.callback_handler.callbacks == [recorder]
    trainer.train()
    assert recorder.calls[0] == ("on_train_begin", 0)  # added after on_init_end


def test_callback_args_are_the_config_under_trls_names(tmp_path, tokenizer):
    seen = {}

    class Reads(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.update(output_dir=args.output_dir, logging_steps=args.logging_steps, max_steps=args.max_steps,
                        seed=args.seed, should_save=args.should_save, process_index=args.process_index,
                        world_size=args.world_size, logging_strategy=args.logging_strategy,
                        report_to=args.report_to, token=args.to_dict()["hub_token"])
            assert args.deepspeed is None  # a TRL setting at the value that says what covey does
            with pytest.raises(AttributeError, match="args.deepspeed_plugin, which covey's GRPOConfig does not have"):
                args.deepspeed_plugin
            with pytest.raises(AttributeError, match="a run's settings are fixed"):
                args.learning_rate = 1.0
            json.loads(args.to_json_string())

    trainer_for(small_args(tmp_path, max_steps=1, hub_token="hf_secret"), tokenizer, callbacks=[Reads()]).train()
    assert seen == dict(output_dir=str(tmp_path / "run"), logging_steps=1, max_steps=1, seed=42, should_save=True,
                        process_index=0, world_size=1, logging_strategy="steps", report_to=["none"],
                        token="<HUB_TOKEN>")


def test_something_that_is_no_callback_is_refused_before_the_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="callbacks: .*print.* has none of a callback's methods"):
        GRPOTrainer(model=str(tmp_path / "never-loaded"), reward_funcs=[count_a], args=small_args(tmp_path),
                    train_dataset=ROWS, callbacks=[print])


def _two_processes_with_callbacks(rank: int, port: int, output_dir: str, results: str) -> None:
    """Process 1 alone asks to stop after step 2: both processes stop there, and each got the logs."""
    as_launched(rank, port)
    torch.set_num_threads(1)
    recorder, tokenizer = Recorder(), make_tokenizer()
    callbacks = [recorder, StopAt(2)] if rank == 1 else [recorder]
    args = small_args(Path(output_dir), max_steps=5, gradient_accumulation_steps=1, eval_max_samples=0)
    trainer = trainer_for(args, tokenizer, callbacks=callbacks)
    trainer.train()
    Path(f"{results}-{rank}.json").write_text(json.dumps({
        "steps": trainer.global_step, "calls": recorder.calls, "logs": trainer.state.log_history,
        "zero": trainer.state.is_world_process_zero}))
    torch.distributed.destroy_process_group()


def test_under_two_processes_every_process_calls_its_callbacks_and_a_stop_in_one_stops_both(tmp_path):
    results = str(tmp_path / "results")
    run_in_two_processes(_two_processes_with_callbacks, (free_port(), str(tmp_path), results))
    first, second = (json.loads(Path(f"{results}-{rank}.json").read_text()) for rank in (0, 1))
    assert first["steps"] == second["steps"] == 2 and first["calls"] == second["calls"]
    assert first["logs"] == second["logs"] and [e["step"] for e in first["logs"]] == [1, 2, 2]
    assert first["logs"][-1]["train_loss"] == pytest.approx((first["logs"][0]["loss"] + first["logs"][1]["loss"]) / 2)
    assert first["logs"][-1]["reward"] == first["logs"][1]["reward"]
    assert "reward" in second["logs"][0]  # the metrics the first process computed
    assert (first["zero"], second["zero"]) == (True, False)


# ---- save_strategy and save_only_model ------------------------------------------------------------


@pytest.mark.parametrize("async_generation", [False, True])
def test_save_strategy_epoch_checkpoints_at_the_end_of_each_pass_over_the_prompts(tmp_path, tokenizer,
                                                                                 async_generation):
    """3 prompts a round of 8 rows: the first pass ends within round 3, the second within round 6 (the
    rounds trained: under async_generation the worker has drawn the next round's prompts already)."""
    args = small_args(tmp_path, max_steps=7, per_device_train_batch_size=12, gradient_accumulation_steps=1,
                      save_strategy="epoch", save_steps=1, save_total_limit=None, eval_max_samples=0,
                      async_generation=async_generation)
    trainer_for(args, tokenizer).train()
    assert [step_of(p) for p in checkpoint_dirs(tmp_path / "run")] == [3, 6]


@pytest.mark.parametrize("text, strategy", [("save_strategy: no", "no"), ("save_strategy: 'no'", "no"),
                                            ("save_strategy: epoch", "epoch"), ("", "steps")])
def test_save_strategy_reads_as_trl_writes_it(tmp_path, text, strategy):
    config = tmp_path / "c.yaml"
    config.write_text(text + "\n")
    assert GRPOConfig.from_yaml(config).save_strategy == strategy


def test_save_strategy_no_writes_no_checkpoints(tmp_path, tokenizer):
    trainer_for(small_args(tmp_path, max_steps=2, save_strategy="no", save_steps=1, eval_max_samples=0), tokenizer).train()
    assert not (tmp_path / "run" / "checkpoints").exists() and (tmp_path / "run" / "final_model").is_dir()


def test_save_only_model_checkpoints_hold_the_model_alone_and_cannot_be_resumed(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    args = small_args(tmp_path, max_steps=2, save_steps=1, save_only_model=True, eval_max_samples=0)
    trainer = trainer_for(args, tokenizer)
    trainer.train()
    newest = checkpoint_dirs(tmp_path / "run")[-1]
    assert sorted(p.name for p in newest.iterdir()) == ["model", "state.json"]
    reloaded = AutoModelForCausalLM.from_pretrained(newest / "model")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.parameters(), final.parameters()))
    for spec in ("auto", str(newest)):
        with pytest.raises(ConfigError, match="written under save_only_model: true .* cannot resume from it"):
            GRPOTrainer(model=str(tmp_path / "never-loaded"), reward_funcs=[count_a], train_dataset=ROWS,
                        args=small_args(tmp_path, max_steps=3, resume_from_checkpoint=spec))


# ---- push_to_hub --------------------------------------------------------------------------------


class FakeHub:
    """Stands in for the Hub's API: records each upload with the files it would send."""

    def __init__(self, monkeypatch, role="write", unreachable=False):
        self.uploads: list[dict] = []
        self.repos: list[dict] = []
        self.release = threading.Event()
        self.release.set()
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        hub = self

        def whoami(api, token=None, **kwargs):
            if unreachable:
                raise ConnectionError("Failed to resolve 'huggingface.co'")
            return {"name": "someone", "auth": {"accessToken": {"role": role}}}

        def create_repo(api, repo_id, token=None, private=None, exist_ok=False, **kwargs):
            hub.repos.append({"name": repo_id, "private": private, "token": token})
            full = repo_id if "/" in repo_id else f"someone/{repo_id}"
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{full}")

        def upload_folder(api, *, repo_id, folder_path, path_in_repo=None, commit_message=None, token=None,
                          revision=None, **kwargs):
            hub.release.wait(30)
            files = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
            hub.uploads.append({"repo": repo_id, "to": path_in_repo, "message": commit_message, "files": files,
                                "revision": revision, "token": token})

        for name, fake in (("whoami", whoami), ("create_repo", create_repo), ("upload_folder", upload_folder),
                           ("create_branch", lambda api, repo_id, branch, **kw: None)):
            monkeypatch.setattr(huggingface_hub.HfApi, name, fake)


def hub_args(tmp_path, **overrides) -> GRPOConfig:
    return small_args(tmp_path, **{"push_to_hub": True, "hub_token": "hf_test", "save_steps": 1, "eval_max_samples": 0,
                                   **overrides})


@pytest.mark.parametrize("strategy, checkpoint_folder", [("every_save", None), ("checkpoint", "last-checkpoint"),
                                                         ("all_checkpoints", "checkpoint-{step}"), ("end", None)])
def test_push_to_hub_uploads_what_hub_strategy_says(tmp_path, tokenizer, monkeypatch, strategy, checkpoint_folder):
    hub = FakeHub(monkeypatch)
    args = hub_args(tmp_path, hub_strategy=strategy, hub_private_repo=True, hub_revision="runs", hub_always_push=True)
    trainer_for(args, tokenizer).train()
    assert hub.repos == [{"name": "run", "private": True, "token": "hf_test"}]  # output_dir's name, as transformers
    assert {(u["repo"], u["revision"], u["token"]) for u in hub.uploads} == {("someone/run", "runs", "hf_test")}
    expected = []
    for step in (1, 2) if strategy != "end" else ():
        expected.append((None, f"Training in progress, step {step}"))
        if checkpoint_folder:
            expected.append((checkpoint_folder.format(step=step), f"Training in progress, step {step}, checkpoint"))
    expected.append((None, "End of training"))
    assert [(u["to"], u["message"]) for u in hub.uploads] == expected
    final = hub.uploads[-1]["files"]
    assert {"README.md", "model.safetensors", "config.json", "tokenizer.json"} <= set(final)
    if strategy != "end":
        assert "model.safetensors" in hub.uploads[0]["files"] and "optimizer.safetensors" not in hub.uploads[0]["files"]
    if checkpoint_folder:
        assert {"model/model.safetensors", "optimizer.safetensors", "state.json"} <= set(hub.uploads[1]["files"])
    assert not list((tmp_path / "run").glob(".hub-push-*"))  # the hard-linked copies are gone once uploaded
    assert "hf_test" not in (tmp_path / "run" / "config.yaml").read_text()


def test_a_checkpoint_saved_while_the_previous_push_uploads_is_skipped_unless_hub_always_push(
        tmp_path, tokenizer, monkeypatch):
    for always, pushed in ((False, [1]), (True, [1, 2])):
        hub = FakeHub(monkeypatch)
        hub.release.clear()  # the first push hangs until training is over

        class Release(TrainerCallback):
            def on_train_end(self, args, state, control, **kwargs):
                hub.release.set()

        args = hub_args(tmp_path / str(always), hub_always_push=always, save_total_limit=1)
        trainer_for(args, tokenizer, callbacks=[Release()]).train()
        steps = [int(u["message"].rsplit(" ", 1)[1]) for u in hub.uploads if u["message"] != "End of training"]
        assert steps == pushed and hub.uploads[-1]["message"] == "End of training"
        # save_total_limit: 1 deleted checkpoint-1 while it was uploading; its hard-linked copy went up whole
        assert "model.safetensors" in hub.uploads[0]["files"]


@pytest.mark.parametrize("setup, message", [
    (dict(offline=True), "HF_HUB_OFFLINE .* is set: unset it to push, or set push_to_hub: false"),
    (dict(token=None), "needs a Hugging Face token that may write, and none is set: run `hf auth login`"),
    (dict(unreachable=True), "could not reach the Hugging Face Hub .*ConnectionError.* check the network"),
    (dict(role="read"), "the Hugging Face token is read-only"),
    (dict(output_dir=None), "names the repo after output_dir .* give hub_model_id"),
])
def test_a_run_that_cannot_push_is_refused_before_the_model_loads(tmp_path, monkeypatch, setup, message):
    FakeHub(monkeypatch, role=setup.get("role", "write"), unreachable=setup.get("unreachable", False))
    if setup.get("offline"):
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    args = hub_args(tmp_path, hub_token=setup.get("token", "hf_test"))
    if "output_dir" in setup:
        monkeypatch.chdir(tmp_path)
        args = GRPOConfig(**{**args.to_dict(), "output_dir": None})
    with pytest.raises(HubError, match=message):
        GRPOTrainer(model=str(tmp_path / "never-loaded"), reward_funcs=[count_a], args=args, train_dataset=ROWS)


def test_a_failed_final_push_says_how_to_push_the_saved_model(tmp_path, tokenizer, monkeypatch):
    FakeHub(monkeypatch)

    def refused(api, **kwargs):
        raise RuntimeError("503 Service Unavailable")

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", refused)
    with pytest.raises(HubError, match=r"pushing the final model to .*someone/run failed .*503.* it is saved in "
                                       r".*final_model: push it with `hf upload someone/run .*final_model`"):
        trainer_for(hub_args(tmp_path, hub_strategy="end"), tokenizer).train()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


def test_commands_that_train_nothing_push_nothing():
    """covey verify and covey generate build their one batch from the run's config: never a push."""
    from covey.train.setup import one_batch_settings

    assert not one_batch_settings(GRPOConfig(push_to_hub=True, hub_model_id="someone/model"), 2).push_to_hub
