"""What a run writes and shows as it trains: metrics.jsonl, completions.jsonl, the progress bar, the
health warnings and the trackers; and where a run folder keeps the configs it went on with.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from covey.errors import TrainingInterrupted
from covey.telemetry.health import HealthMonitor
from covey.telemetry.plain import is_plain, output_console, print_table
from covey.telemetry.tables import completions_table
from covey.telemetry.text_signals import SAMPLE_STEPS
from covey.telemetry.trackers import Tracker
from covey.vision import jsonable

LIVE_KEYS = (("reward", "reward"), ("reward_std", "std"), ("kl", "kl"), ("completions/mean_length", "len"),
             ("tokens_per_second", "tok/s"))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    return value


class RunLog:
    """Appends metrics and completions as JSON lines, forwards each metrics step to the trackers, and drives
    the console display. Leaving the ``with`` block closes the trackers, also when training raised."""

    def __init__(self, run_dir: Path, total_steps: int, console: Console | None = None, quiet: bool = False,
                 trackers: Sequence[Tracker] = (), record: bool = True):
        self.run_dir = run_dir
        self.record = record  # False: a data-parallel process other than the first, which writes nothing
        self.trackers = list(trackers)
        self.console = console or output_console(stderr=True)
        self.quiet = quiet
        self.total_steps = total_steps
        self.lines = is_plain(self.console)  # for a log: a line per logged step instead of the progress bar
        self.metrics_path = run_dir / "metrics.jsonl"
        self.completions_path = run_dir / "completions.jsonl"
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.description}"),
                                 console=self.console, disable=quiet or self.lines)
        self.task = self.progress.add_task("", total=total_steps)
        self.history: list[dict] = []
        self.samples: list[dict] = []  # recorded completions the health rules read (the first and latest steps)
        self.health = HealthMonitor()

    def __enter__(self) -> "RunLog":
        self.progress.start()
        return self

    def __exit__(self, exc_type: type | None, *_: Any) -> None:
        self.progress.stop()
        outcome = ("finished" if exc_type is None else
                   "killed" if issubclass(exc_type, (TrainingInterrupted, KeyboardInterrupt)) else "failed")
        for tracker in self.trackers:
            try:
                tracker.close(outcome)
            except Exception as e:  # the trained model and summary come first; a tracker's goodbye is optional
                self.info(f"[yellow]{type(tracker).__name__} failed to close ({type(e).__name__}: {e})[/]")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if not self.record:
            return
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.history.append(record)
        warnings = self.health.check(self.history, self.samples)
        flags = {f"health/{key}": 1.0 for key in self.health.keys if not key.endswith("-info")}
        record.update(flags)  # the step each warning first showed, for the report and the trackers
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for tracker in list(self.trackers):
            try:
                tracker.log(step, {**metrics, **flags})
            except Exception as e:  # a tracker's outage (a server down, a full disk) must not end the training
                self.trackers.remove(tracker)
                with contextlib.suppress(Exception):
                    tracker.close("failed")
                self.info(f"[yellow]step {step}: {type(tracker).__name__} failed ({type(e).__name__}: {e}); it gets no "
                          "more metrics in this run (metrics.jsonl has them all)[/]")
        live = "  ".join(f"{label} {metrics[key]:.3g}" for key, label in LIVE_KEYS if key in metrics)
        self.progress.update(self.task, completed=step, description=live)
        if self.lines:
            self.info(f"step {step}/{self.total_steps}  {live}")
        for message in warnings:
            self.info(f"[yellow]step {step}: {escape(message)}[/]")

    def resume(self, history: list[dict], step: int) -> None:
        """Continue a run from a checkpoint at ``step``: its metric history, and the files cut back to
        that step (lines a crashed run wrote after its checkpoint are written again as training redoes them)."""
        self.history = list(history)
        self.health.resume(self.history)
        if not self.record:
            return
        _rewrite_jsonl(self.metrics_path, self.history)
        if self.completions_path.exists():
            records = []
            for line in self.completions_path.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a line cut off by the crash is dropped
                    records.append(json.loads(line))
            kept = [r for r in records if r.get("step", 0) <= step]
            _rewrite_jsonl(self.completions_path, kept)
            self._keep_samples(kept)
        self.progress.update(self.task, completed=step)

    def log_completions(self, step: int, records: list[dict], num_to_print: int | None = 0) -> None:
        """Append the step's completions to completions.jsonl; show the first ``num_to_print`` (None: all) as
        a table."""
        if not self.record:
            return
        with open(self.completions_path, "a") as f:
            for record in records:
                f.write(json.dumps({"step": step, **record}, default=jsonable) + "\n")  # a picture: its label
        self._keep_samples(self.samples + [{"step": step, **record} for record in records])
        if num_to_print != 0 and not self.quiet:
            print_table(self.console, completions_table(records[:num_to_print], title=f"step {step}: sample completions"))

    def _keep_samples(self, records: list[dict]) -> None:
        """Keep the completions of the first and latest SAMPLE_STEPS recorded steps: what the text rules compare."""
        steps = sorted({r.get("step", 0) for r in records})
        kept = set(steps[:SAMPLE_STEPS] + steps[-SAMPLE_STEPS:])
        self.samples = [r for r in records if r.get("step", 0) in kept]

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message)

    def say_from_signal_handler(self, message: str) -> None:
        """``message`` said by a signal handler, which runs wherever the main thread was, a print through
        the console (and the imports it makes on first use) included: plain text written straight to
        standard error, never through the console again."""
        if self.quiet:
            return
        try:
            os.write(sys.stderr.fileno(), f"{message}\n".encode())
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):  # a stream with no descriptor
            sys.stderr.write(f"{message}\n")


def write_json(path: Path, value: Any) -> None:
    """``value`` as indented JSON (NaN and inf as null), in one rename."""
    def cleaned(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: cleaned(x) for k, x in v.items()}
        return [cleaned(x) for x in v] if isinstance(v, (list, tuple)) else _clean(v)

    _replace(path, json.dumps(cleaned(value), indent=2))


def _rewrite_jsonl(path: Path, records: list[dict]) -> None:
    """Replace a JSON-lines file in one rename."""
    _replace(path, "".join(json.dumps(r, default=jsonable) + "\n" for r in records))


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` in one rename, so a crash leaves the old or the new file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def resumed_configs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of each config.resumed-at-N.yaml of a run folder (a resume with changed settings), by step."""
    found = [(int(m.group(1)), p) for p in Path(run_dir).glob("config.resumed-at-*.yaml")
             if (m := re.fullmatch(r"config\.resumed-at-(\d+)\.yaml", p.name))]
    return sorted(found)


def latest_run_config(run_dir: Path) -> Path:
    """The config a run folder's run last went on with: the last resume's, else config.yaml."""
    return ([Path(run_dir) / "config.yaml"] + [path for _, path in resumed_configs(run_dir)])[-1]
