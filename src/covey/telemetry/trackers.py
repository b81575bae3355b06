"""Metric trackers: every logged step also goes to the ones named in ``report_to``.

TensorBoard, W&B, Trackio and MLflow are optional extras, imported only by a run that names them.
``check_trackers`` runs before the model loads, so a missing package is reported at once rather than
after minutes of loading; ``make_trackers`` opens them when training starts. metrics.jsonl is written
whatever ``report_to`` says (see ``covey.telemetry.runlog``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import netrc
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from covey.errors import ConfigError, warn

PROJECT = "covey"  # the default project / experiment that runs are grouped under
WANDB_OFFLINE_MODES = ("offline", "dryrun", "disabled")


class Tracker(Protocol):
    """Where a run's metrics also go: ``log`` once per logged step, ``close`` once at the end with how the
    run ended: "finished", "failed" (an error) or "killed" (stopped by a signal or Ctrl-C)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, outcome: str = "finished") -> None: ...


def _param(value: Any) -> bool | int | float | str:
    """A config value as hyperparameter tables take it: scalars as they are, lists and None as text."""
    return value if isinstance(value, (bool, int, float, str)) else str(value)


class TensorBoardTracker:
    """Scalars in RUN_DIR/tensorboard/ (``tensorboard --logdir RUN_DIR/tensorboard``); the config as HParams."""

    def __init__(self, run_dir: Path, config: dict[str, Any], first_step: int = 1):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # a resumed run hides what the interrupted one logged from first_step on (it is logged again)
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=first_step if first_step > 1 else None)
        # the HParams records go into this run's own event file (add_hparams would open a second run)
        for summary in hparams({key: _param(value) for key, value in config.items()}, {}):
            self.writer.file_writer.add_summary(summary)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def close(self, outcome: str = "finished") -> None:
        self.writer.close()


def wandb_key_configured() -> bool:
    """Whether W&B has credentials without asking: WANDB_API_KEY (or an identity token file), or the netrc
    entry for the W&B host that ``wandb login`` writes."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    try:
        return netrc.netrc(os.environ.get("NETRC") or os.path.expanduser("~/.netrc")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class _RunTracker:
    """A tracker whose run object takes ``log(metrics, step=...)`` and ``finish()`` (W&B, Trackio)."""

    run: Any

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, outcome: str = "finished") -> None:
        self.run.finish()


class WandbTracker(_RunTracker):
    """A W&B run saved under RUN_DIR/wandb/, in the project WANDB_PROJECT (default "covey").

    WANDB_MODE is respected. Without it and without an API key the run is logged offline (``wandb sync``
    uploads it later): a training run must never stop at a login prompt.
    """

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]):
        import wandb

        mode = None  # wandb reads WANDB_MODE itself
        if "WANDB_MODE" not in os.environ and not wandb_key_configured():
            mode = "offline"
            warn(f"report_to wandb: no W&B API key is configured (WANDB_API_KEY or `wandb login`), so "
                          f"the run is logged offline in {run_dir / 'wandb'}; upload it later with "
                          f"`wandb sync {run_dir / 'wandb'}/offline-run-*`", stacklevel=2)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, dir=str(run_dir),
                              config=config, mode=mode)

    def close(self, outcome: str = "finished") -> None:
        self.run.finish(exit_code=0 if outcome == "finished" else 1)  # W&B marks a non-zero exit as failed


class TrackioTracker(_RunTracker):
    """A run in Trackio's local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio; ``trackio show``
    opens it), in ``project`` (default: TRACKIO_PROJECT, else "covey"). Trackio needs no network unless
    TRACKIO_SPACE_ID names a Hugging Face Space to sync to."""

    def __init__(self, run_name: str, config: dict[str, Any], project: str | None = None):
        import trackio

        self.run = trackio.init(project=project or os.environ.get("TRACKIO_PROJECT", PROJECT), name=run_name,
                                config=config)


class MLflowTracker:
    """An MLflow run in the experiment MLFLOW_EXPERIMENT_NAME (default "covey"), the config as its params.

    Without MLFLOW_TRACKING_URI the store is a SQLite file in the run folder, RUN_DIR/mlflow.db (MLflow's
    local default backend; ``mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db`` shows it).
    """

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        local = not os.environ.get("MLFLOW_TRACKING_URI")
        self.client = MlflowClient(f"sqlite:///{(run_dir / 'mlflow.db').resolve()}" if local else None)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = (run_dir / "mlartifacts").resolve().as_uri() if local else None
            experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.client.log_batch(self.run_id, params=[Param(key, str(value)) for key, value in config.items()])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(MLFLOW_REFUSED.sub("_", key), value, now, step)
                                                    for key, value in metrics.items()])

    def close(self, outcome: str = "finished") -> None:
        self.client.set_terminated(self.run_id, status={"failed": "FAILED", "killed": "KILLED"}.get(outcome, "FINISHED"))


# what MLflow refuses in a metric name ("rewards/<lambda>/mean" from a lambda reward): each becomes "_"
MLFLOW_REFUSED = re.compile(r"[^A-Za-z0-9_\-. :/]")


def _missing_module(tracker: str) -> str | None:
    """The first module ``tracker`` needs that is not installed (found without importing anything heavy)."""
    needed = [tracker]
    if tracker == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI"):
        needed += ["sqlalchemy", "alembic"]  # the local SQLite store; mlflow-skinny lacks them
    return next((module for module in needed if importlib.util.find_spec(module) is None), None)


def check_trackers(report_to: list[str]) -> None:
    """Raise ConfigError now, before any model loads, for a tracker that could not start."""
    for tracker in report_to:
        if tracker == "none":
            continue
        missing = _missing_module(tracker)
        if missing is not None:
            raise ConfigError(f"report_to: {tracker!r} needs the {missing!r} package, which is not installed; "
                              f"install it with pip install 'covey[{tracker}]' or drop {tracker!r} from report_to")
        mode = os.environ.get("WANDB_MODE")
        if tracker == "wandb" and mode and mode not in WANDB_OFFLINE_MODES and not wandb_key_configured():
            raise ConfigError(f"report_to: 'wandb' with WANDB_MODE={mode} needs a W&B API key, and none is "
                              f"configured; set WANDB_API_KEY or run `wandb login` first, or set WANDB_MODE=offline")


def make_trackers(report_to: list[str], run_dir: Path, run_name: str, config: dict[str, Any],
                  first_step: int = 1, project: str | None = None) -> list[Tracker]:
    """Open the trackers named in ``report_to`` ("none" or an empty list: none) for one run, whose
    next logged step is ``first_step`` (later than 1 when it resumes); ``project``: Trackio's project."""
    names = [name for name in dict.fromkeys(report_to) if name != "none"]
    if names:
        run_dir.mkdir(parents=True, exist_ok=True)  # W&B and the MLflow store need the folder to exist
    makers = {
        "tensorboard": lambda: TensorBoardTracker(run_dir, config, first_step),
        "wandb": lambda: WandbTracker(run_dir, run_name, config),
        "trackio": lambda: TrackioTracker(run_name, config, project),
        "mlflow": lambda: MLflowTracker(run_dir, run_name, config),
    }
    opened: list[Tracker] = []
    for name in names:
        try:
            opened.append(makers[name]())
        except Exception as e:
            for tracker in opened:
                with contextlib.suppress(Exception):
                    tracker.close("failed")
            raise ConfigError(f"report_to: {name!r} could not start ({type(e).__name__}: {e}); fix its settings "
                              f"or drop {name!r} from report_to") from e
    return opened
