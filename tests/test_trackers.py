"""report_to: each tracker's files are read back with the tracker's own reader (or its file format), offline."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from covey.config import GRPOConfig
from covey.errors import ConfigError
from covey.telemetry.runlog import RunLog
from covey.telemetry.trackers import check_trackers, make_trackers, wandb_key_configured

CONFIG = GRPOConfig(learning_rate=3e-6, reward_funcs=["answer_format", "answer_correct"]).to_dict()
# values a float32 holds exactly (TensorBoard stores float32); a NaN at step 2 must pass without a crash
STEPS = {
    1: {"loss": 0.5, "rewards/answer_correct/mean": 0.25, "completions/mean_length": 12.0},
    2: {"loss": float("nan"), "rewards/answer_correct/mean": 0.5, "completions/mean_length": 10.0},
    3: {"loss": -0.125, "rewards/answer_correct/mean": 0.75, "completions/mean_length": 9.5},
}


def log_steps(tracker) -> None:
    for step, metrics in STEPS.items():
        tracker.log(step, metrics)
    tracker.close()


def assert_same(got: float, want: float) -> None:
    assert (math.isnan(got) and math.isnan(want)) or got == want, (got, want)


def assert_history(history: dict[int, dict[str, float]]) -> None:
    """``history`` (step -> metrics as the tracker stored them) holds exactly STEPS."""
    assert sorted(history) == sorted(STEPS)
    for step, metrics in STEPS.items():
        assert set(history[step]) == set(metrics), step
        for key, value in metrics.items():
            assert_same(history[step][key], value)


# ---- TensorBoard -------------------------------------------------------------------------------

def test_tensorboard_event_files_hold_the_logged_scalars_and_the_config(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    [tracker] = make_trackers(["tensorboard"], tmp_path, "run-1", CONFIG)
    log_steps(tracker)

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    history: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            history.setdefault(event.step, {})[tag] = event.value
    assert_history(history)

    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["learning_rate"].number_value == 3e-6
    assert hparams["reward_funcs"].string_value == "['answer_format', 'answer_correct']"


# ---- W&B ---------------------------------------------------------------------------------------

WANDB_BLOCK, WANDB_HEADER, WANDB_CHUNK_HEADER = 32768, 7, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path: Path) -> list:
    """The Record protos of a .wandb file: after a 7-byte header, 32 KiB blocks of chunks (crc32, length,
    kind; a record longer than a block's room is split into first/middle/last chunks; a block's tail too
    short for a chunk header is padding)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", WANDB_HEADER
    while pos + WANDB_CHUNK_HEADER <= len(data):
        room = WANDB_BLOCK - pos % WANDB_BLOCK
        if room < WANDB_CHUNK_HEADER:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + WANDB_CHUNK_HEADER])
        assert kind in (FULL, FIRST, MIDDLE, LAST), f"unexpected chunk kind {kind} at byte {pos}"
        pending += data[pos + WANDB_CHUNK_HEADER:pos + WANDB_CHUNK_HEADER + length]
        pos += WANDB_CHUNK_HEADER + length
        if kind in (FULL, LAST):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """W&B with its caches in tmp_path, no console capture, and no credentials anywhere."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_PROJECT", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))


def wandb_history(run_dir: Path) -> tuple[dict[int, dict[str, float]], dict]:
    """(step -> metrics, config) of the one offline run under run_dir/wandb."""
    import wandb

    wandb.teardown()  # the run file is written by W&B's service process, which may still be flushing it
    [offline] = (run_dir / "wandb").glob("offline-run-*")
    [log_file] = offline.glob("run-*.wandb")
    history, config = {}, {}
    for record in read_wandb_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    return history, config


def test_wandb_offline_run_holds_the_logged_history_and_the_config(tmp_path, wandb_env, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    [tracker] = make_trackers(["wandb"], tmp_path, "run-1", CONFIG)
    log_steps(tracker)

    history, config = wandb_history(tmp_path)
    assert_history(history)
    assert config["learning_rate"] == 3e-6
    assert config["reward_funcs"] == ["answer_format", "answer_correct"]


def test_wandb_without_api_key_logs_offline_and_says_so(tmp_path, wandb_env):
    assert not wandb_key_configured()
    with pytest.warns(UserWarning, match="no W&B API key.*offline.*wandb sync"):
        [tracker] = make_trackers(["wandb"], tmp_path, "run-1", CONFIG)
    log_steps(tracker)
    assert_history(wandb_history(tmp_path)[0])


def test_wandb_key_comes_from_the_environment_or_the_netrc_entry(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc_path = tmp_path / "netrc"
    netrc_path.write_text("machine example.org login me password secret\n")
    monkeypatch.setenv("NETRC", str(netrc_path))
    assert not wandb_key_configured()
    netrc_path.write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    assert wandb_key_configured()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.mycompany.example")
    assert not wandb_key_configured()
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert wandb_key_configured()


def test_wandb_online_without_api_key_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())  # as if wandb were installed
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError, match="WANDB_MODE=online needs a W&B API key.*WANDB_API_KEY.*wandb login"):
        check_trackers(["wandb"])
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_trackers(["wandb"])


# ---- MLflow ------------------------------------------------------------------------------------

def test_mlflow_run_in_the_run_folder_holds_metrics_and_params(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    pytest.importorskip("sqlalchemy", reason="mlflow's local SQLite store (sqlalchemy) is not installed")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # nothing may land in the working directory
    run_dir = tmp_path / "run"  # not created yet: make_trackers makes it
    [tracker] = make_trackers(["mlflow"], run_dir, "run-1", CONFIG)
    log_steps(tracker)

    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert run.info.run_name == "run-1" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "covey"
    assert run.data.params["learning_rate"] == "3e-06"
    assert run.data.params["reward_funcs"] == "['answer_format', 'answer_correct']"
    history: dict[int, dict[str, float]] = {}
    for key in STEPS[1]:
        for metric in client.get_metric_history(tracker.run_id, key):
            history.setdefault(metric.step, {})[key] = metric.value
    assert_history(history)
    assert list((tmp_path / "cwd").iterdir()) == []

    # a tracking URI the user set wins: the next run goes there, not into its own run folder
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    other_dir = tmp_path / "other"
    [tracker] = make_trackers(["mlflow"], other_dir, "run-2", CONFIG)
    tracker.close()
    assert client.get_run(tracker.run_id).info.run_name == "run-2"
    assert not (other_dir / "mlflow.db").exists()

    # names MLflow refuses are mended rather than dropping the tracker; a failed run is marked so
    [tracker] = make_trackers(["mlflow"], other_dir, "run-3", CONFIG)
    tracker.log(1, {"rewards/<lambda>/mean": 0.5})
    tracker.close("failed")
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.data.metrics == {"rewards/_lambda_/mean": 0.5}


# ---- Trackio -----------------------------------------------------------------------------------

TRACKIO_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from trackio.sqlite_storage import SQLiteStorage
    from covey.telemetry.trackers import make_trackers

    steps = {int(k): v for k, v in json.loads(sys.argv[1]).items()}
    project = sys.argv[3] or None  # the config's project (TRL's field); none: covey's
    [tracker] = make_trackers(["trackio"], Path("run"), "run-1", json.loads(sys.argv[2]), project=project)
    for step, metrics in steps.items():
        tracker.log(step, metrics)
    tracker.close()
    print("RESULT", json.dumps({"logs": SQLiteStorage.get_logs(project or "covey", "run-1"),
                                "config": SQLiteStorage.get_run_config(project or "covey", "run-1")}))
""")


@pytest.mark.parametrize("project", ["", "my-project"])
def test_trackio_local_store_holds_the_logged_history_and_the_config(tmp_path, project):
    pytest.importorskip("trackio", reason="the trackio extra is not installed")
    # trackio fixes its store folder (TRACKIO_DIR) at import, so the run happens in a fresh interpreter
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKIO_")}
    env.update(TRACKIO_DIR=str(tmp_path / "store"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", TRACKIO_SCRIPT, json.dumps(STEPS), json.dumps(CONFIG), project],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [result] = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert_history({row["step"]: {k: v for k, v in row.items() if k not in ("step", "timestamp")}
                    for row in result["logs"]})
    assert result["config"]["learning_rate"] == 3e-6
    assert result["config"]["reward_funcs"] == ["answer_format", "answer_correct"]
    assert (tmp_path / "store" / f"{project or 'covey'}.db").exists()


# ---- choosing and checking -----------------------------------------------------------------------

@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "trackio", "mlflow"])
def test_a_missing_tracker_package_names_the_extra_to_install(tracker, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(ConfigError, match=rf"report_to: '{tracker}'.*pip install 'covey\[{tracker}\]'"):
        check_trackers(["none", tracker])


def test_mlflow_local_store_needs_sqlalchemy_unless_a_tracking_uri_is_set(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "sqlalchemy" else object())
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match=r"'sqlalchemy'.*pip install 'covey\[mlflow\]'"):
        check_trackers(["mlflow"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    check_trackers(["mlflow"])


@pytest.mark.parametrize("report_to", [[], ["none"]])
def test_none_means_no_trackers(report_to, tmp_path):
    check_trackers(report_to)
    assert make_trackers(report_to, tmp_path, "run-1", CONFIG) == []
    assert list(tmp_path.iterdir()) == []


class RecordingTracker:
    def __init__(self):
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed = False
        self.outcome = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append((step, metrics))

    def close(self, outcome: str = "finished") -> None:
        self.closed, self.outcome = True, outcome


def test_run_log_forwards_every_step_and_closes_trackers_when_training_raises(tmp_path):
    first, second = RecordingTracker(), RecordingTracker()
    with pytest.raises(RuntimeError, match="boom"):
        with RunLog(tmp_path, total_steps=3, quiet=True, trackers=[first, second]) as log:
            for step, metrics in STEPS.items():
                log.log_metrics(step, metrics)
            assert not first.closed
            raise RuntimeError("boom")
    for tracker in (first, second):
        assert tracker.closed and tracker.outcome == "failed"
        assert [step for step, _ in tracker.logged] == [1, 2, 3]
        assert_history(dict(tracker.logged))
    # metrics.jsonl is written as before, the NaN as null
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3] and lines[1]["loss"] is None


class FailingTracker(RecordingTracker):
    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step == 2:
            raise ConnectionError("tracking server unreachable")
        super().log(step, metrics)


def test_a_tracker_that_fails_is_dropped_and_the_others_keep_logging(tmp_path):
    failing, healthy = FailingTracker(), RecordingTracker()
    with RunLog(tmp_path, total_steps=3, quiet=True, trackers=[failing, healthy]) as log:
        for step, metrics in STEPS.items():
            log.log_metrics(step, metrics)
    assert [s for s, _ in failing.logged] == [1] and [s for s, _ in healthy.logged] == [1, 2, 3]
    assert failing.closed and healthy.closed and healthy.outcome == "finished"


def test_a_run_stopped_by_a_signal_closes_its_trackers_as_killed(tmp_path):
    from covey.errors import TrainingInterrupted

    tracker = RecordingTracker()
    with pytest.raises(TrainingInterrupted):
        with RunLog(tmp_path, total_steps=3, quiet=True, trackers=[tracker]):
            raise TrainingInterrupted("stopped by SIGTERM; checkpoint saved", 15)
    assert tracker.outcome == "killed"


def test_tensorboard_of_a_resumed_run_shows_each_step_once(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [crashed] = make_trackers(["tensorboard"], tmp_path, "run-1", CONFIG)
    for step in range(1, 6):  # the crashed run got to step 5; its last checkpoint was at step 3
        crashed.log(step, {"reward": float(step)})
    crashed.close("failed")
    [resumed] = make_trackers(["tensorboard"], tmp_path, "run-1", CONFIG, first_step=4)
    for step in range(4, 7):
        resumed.log(step, {"reward": 10.0 + step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0)]


def test_a_training_run_sends_the_metrics_of_metrics_jsonl_to_tensorboard(tmp_path, tokenizer):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from covey import GRPOTrainer
    from tests.conftest import make_model
    from tests.test_trainer import ROWS, count_a, small_args

    args = small_args(tmp_path, max_steps=3, eval_max_samples=0, report_to=["tensorboard"])
    GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[count_a], args=args, train_dataset=ROWS,
                processing_class=tokenizer, quiet=True).train()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward", "loss", "completions/mean_length", "learning_rate"):
        assert [(e.step, e.value) for e in events.Scalars(key)] == [
            (m["step"], pytest.approx(m[key], rel=1e-6)) for m in logged], key


def test_a_missing_tracker_stops_the_trainer_before_the_model_loads(tmp_path, monkeypatch):
    from covey import GRPOTrainer
    from tests.test_trainer import ROWS, count_a, small_args

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"covey\[wandb\]"):
        GRPOTrainer(model="no/such-model-is-loaded", reward_funcs=[count_a], train_dataset=ROWS,
                    args=small_args(tmp_path, report_to=["wandb"]))


def test_summary_json_is_strict_json_written_in_one_rename(tmp_path):
    from covey.telemetry.runlog import write_json

    path = tmp_path / "summary.json"
    path.write_text("{\"the previous\": \"summary\"}")
    write_json(path, {"mean_reward": float("nan"), "curve": [float("inf"), 1.5], "after": {"kl": float("-inf")}})

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    assert json.loads(path.read_text(), parse_constant=refuse) == {
        "mean_reward": None, "curve": [None, 1.5], "after": {"kl": None}}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
