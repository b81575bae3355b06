"""The run report: PNG plots of a run's training curves and one self-contained HTML page, and the
overlay of one metric across several runs.

A run folder (written by ``covey train``) holds config.yaml, metrics.jsonl, completions.jsonl and
summary.json. The report only reads them. Its own folder (default RUN_DIR/report/) holds report.html
and the plot PNGs; regenerating overwrites those, deletes plots whose metric is no longer logged, and
leaves every other file alone. The page embeds the plots as data URIs and loads nothing from outside,
so it can be mailed or archived on its own. Texts from the run (prompts, completions, config values)
are escaped: model output is never trusted as HTML.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from covey.config import RESUME_FIELDS, GRPOConfig
from covey.data.text import prompt_text
from covey.errors import ConfigError, DataError
from covey.telemetry.probe_findings import probes_html
from covey.telemetry.runlog import resumed_configs
from covey.telemetry.tables import before_after_rows

SMOOTH_FROM = 20  # with at least this many points, raw values are drawn faintly under a moving average
SAMPLES_PER_STEP = 8  # completions shown for each of the first and last recorded steps
GENERATOR = '<meta name="generator" content="covey report">'  # marks a folder as covey's to rewrite
FUNCTION_PLOT_PREFIX = "rewards-"
COLORS = ("#1f6feb", "#d1495b", "#2a9d8f", "#e9a03b", "#7b5ea7", "#5c677d", "#8ab17d", "#c8553d")


@dataclass(frozen=True)
class Panel:
    """One plot: a metric key drawn against the step, optionally between two band keys (min, max)."""

    name: str
    title: str
    key: str
    band: tuple[str, str] | None = None


@dataclass
class Run:
    """What a run folder holds, as read from its files; ``notes`` says what is missing."""

    path: Path
    metrics: list[dict]
    config: dict | None = None
    completions: list[dict] = field(default_factory=list)
    summary: dict | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def reward_functions(self) -> list[str]:
        """Reward function names in the order their ``rewards/<fn>/mean`` metric first appears."""
        names: dict[str, None] = {}
        for record in self.metrics:
            for key in record:
                match = re.fullmatch(r"rewards/(.+)/mean", key)
                if match:
                    names.setdefault(match.group(1))
        return list(names)


@dataclass(frozen=True)
class Plot:
    panel: Panel
    png: bytes
    first: float
    last: float


# ---- reading a run folder -------------------------------------------------------------------------

def _read_jsonl(path: Path) -> tuple[list[dict], bool]:
    """The records of a JSON-lines file, and whether a cut-off last line (a run killed mid-write) was dropped."""
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                return records, True
            raise DataError(f"{path}, line {number}: not valid JSON ({e.msg}); fix or delete that line") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}, line {number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records, False


def load_run(run_dir: str | Path) -> Run:
    """Read a run folder; raises ConfigError for a folder that is not a run, DataError for one without metrics."""
    path = Path(run_dir)
    if not path.exists():
        raise ConfigError(f"run folder {path} does not exist: give the output_dir of a covey train run")
    if not path.is_dir():
        raise ConfigError(f"{path} is a file, not a run folder: give the output_dir of a covey train run")
    metrics_path, config_path = path / "metrics.jsonl", path / "config.yaml"
    if not metrics_path.is_file() and not config_path.is_file():
        raise ConfigError(f"{path} is not a run folder: it has neither metrics.jsonl nor config.yaml "
                          "(covey train writes both into its output_dir)")
    if not metrics_path.is_file():
        raise DataError(f"{path} has no metrics.jsonl: the run logged no step yet "
                        "(a line is written every logging_steps optimizer steps)")
    metrics, cut = _read_jsonl(metrics_path)
    for number, record in enumerate(metrics, 1):
        if not isinstance(record.get("step"), (int, float)):
            raise DataError(f"{metrics_path}: record {number} has no numeric 'step'")
    if not metrics:
        raise DataError(f"{metrics_path} is empty: the run logged no step yet "
                        "(a line is written every logging_steps optimizer steps)")
    run = Run(path=path, metrics=metrics)
    if cut:
        run.notes.append("the last line of metrics.jsonl was cut off (the run stopped while writing it)")

    if config_path.is_file():
        try:
            config = yaml.safe_load(config_path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            config = None
            run.notes.append(f"config.yaml could not be read ({type(e).__name__}): the config is not shown")
        else:
            if not isinstance(config, dict):
                raise DataError(f"{config_path} is not a mapping of config fields")
        run.config = config
        run.notes.extend(_resumed_with_changes(path, config))
    else:
        run.notes.append("no config.yaml: the config is not shown")

    completions_path = path / "completions.jsonl"
    if completions_path.is_file():
        run.completions, cut = _read_jsonl(completions_path)
        if cut:
            run.notes.append("the last line of completions.jsonl was cut off (the run stopped while writing it)")
    else:
        run.notes.append("no completions.jsonl (log_completions was off): no sample completions are shown")

    summary_path = path / "summary.json"
    if summary_path.is_file():
        try:
            run.summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{summary_path} is not valid JSON ({e.msg}); delete it to report the run without it") \
                from None
        if not (run.summary.get("before") and run.summary.get("after")):
            run.notes.append("the run had no held-out evaluation (no eval split, or eval_max_samples 0)")
    else:
        run.notes.append("no summary.json: the run did not finish (or is still running), "
                         "so there is no before/after evaluation")
    return run


def metric_series(metrics: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and values of one metric over the records that have it; null and NaN become NaN."""
    pairs = [(r["step"], r[key]) for r in metrics if key in r]
    steps = np.array([p[0] for p in pairs], dtype=float)
    values = np.array([np.nan if v is None else float(v) for _, v in pairs], dtype=float)
    return steps, values


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Centred mean over ``window`` points (odd), narrowing at the ends so the curve keeps its length."""
    kernel = np.ones(window)
    return np.convolve(values, kernel, "same") / np.convolve(np.ones_like(values), kernel, "same")


# ---- plots ----------------------------------------------------------------------------------------

def panels(run: Run) -> list[Panel]:
    """The report's plots, in page order; those with no finite value are left out by ``draw``."""
    functions = run.reward_functions
    return [
        Panel("reward", "reward (weighted total, batch mean)", "reward"),
        *(Panel(FUNCTION_PLOT_PREFIX + _file_safe(fn), f"reward function {fn} (mean)", f"rewards/{fn}/mean")
          for fn in functions),
        *((Panel("eval_accuracy", "held-out accuracy during training (greedy; eval_strategy: steps)", "eval/accuracy"),
           Panel("eval_reward", "held-out mean reward during training", "eval/mean_reward"))
          if any("eval/mean_reward" in record for record in run.metrics) else ()),  # only runs that evaluated during training
        Panel("reward_std", "reward_std (spread over the batch)", "reward_std"),
        Panel("kl", "KL to the reference", "kl"),
        Panel("completion_length", "completion length (tokens; band: min to max)", "completions/mean_length",
              ("completions/min_length", "completions/max_length")),
        Panel("entropy", "entropy (nats per token)", "entropy"),
        Panel("learning_rate", "learning rate", "learning_rate"),
        # async_generation only
        Panel("async_staleness", "staleness (optimizer steps the sampling policy lagged the trained one)",
              "async/staleness"),
        Panel("async_wait_for_data", "seconds the trainer waited for a sampled round", "time/wait_for_data"),
        Panel("async_queue_depth", "rounds sampled ahead, waiting", "async/queue_depth"),
    ]


def _file_safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _draw_series(ax: Any, steps: np.ndarray, values: np.ndarray, color: str, label: str | None = None) -> None:
    """Few points: a line with markers. Many: the raw values faintly and their moving average on top."""
    finite = np.isfinite(values)
    if finite.sum() < SMOOTH_FROM:
        ax.plot(steps, values, color=color, marker="o", markersize=3, linewidth=1.5, label=label)
        return
    window = max(3, int(finite.sum()) // 10) | 1
    ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
    ax.plot(steps[finite], moving_average(values[finite], window), color=color, linewidth=2, label=label)


def _figure(title: str) -> tuple[Figure, Any]:
    figure = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    ax.set_title(title, fontsize=11, loc="left")
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return figure, ax


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def draw(run: Run, panel: Panel) -> Plot | None:
    """The panel's plot, or None when the run never logged a finite value of its metric."""
    steps, values = metric_series(run.metrics, panel.key)
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return None
    figure, ax = _figure(panel.title)
    if panel.band:
        band_steps, low = metric_series(run.metrics, panel.band[0])
        high_steps, high = metric_series(run.metrics, panel.band[1])
        if band_steps.size and np.array_equal(band_steps, high_steps):
            ax.fill_between(band_steps, low, high, color=COLORS[0], alpha=0.15, linewidth=0)
    _draw_series(ax, steps, values, COLORS[0])
    if panel.key == "learning_rate":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return Plot(panel, _png(figure), float(finite[0]), float(finite[-1]))


def _remove_stale_plots(out_dir: Path, run: Run, written: set[str]) -> None:
    """Delete plots an earlier report wrote for metrics this run no longer has; nothing else."""
    candidates = [out_dir / f"{panel.name}.png" for panel in panels(run)]
    candidates += out_dir.glob(f"{FUNCTION_PLOT_PREFIX}*.png")
    for path in candidates:
        if path.is_file() and path.name not in written:
            path.unlink()


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the plots and report.html for a run folder into ``out_dir`` (default RUN_DIR/report/);
    returns the page's path."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.path / "report"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"report folder {out} is a file: pass --out with a folder")
    page = out / "report.html"
    if out.is_dir() and any(out.iterdir()) and not (page.is_file() and GENERATOR in page.read_text(errors="replace")):
        raise ConfigError(f"report folder {out} holds files that are not a covey report; pass --out with a new "
                          "folder (a folder with an earlier report is rewritten)")
    out.mkdir(parents=True, exist_ok=True)
    plots = [plot for panel in panels(run) if (plot := draw(run, panel)) is not None]
    for plot in plots:
        (out / f"{plot.panel.name}.png").write_bytes(plot.png)
    _remove_stale_plots(out, run, {f"{plot.panel.name}.png" for plot in plots})
    page.write_text(render_page(run, plots), encoding="utf-8")
    return page


def compare_file_name(metric: str) -> str:
    """The default file of ``covey compare``: compare-<metric>.png, the metric made safe for a file name."""
    return f"compare-{_file_safe(metric)}.png"


def compare_runs(run_dirs: list[str | Path], out_path: str | Path, metric: str = "reward") -> Path:
    """One PNG with ``metric`` of every run against the step, one colour per run; replaces ``out_path``."""
    if not run_dirs:
        raise ConfigError("compare needs at least one run folder")
    runs = [load_run(d) for d in run_dirs]
    labels = [run.path.name or str(run.path) for run in runs]
    if len(set(labels)) < len(labels):  # same folder name under different parents: use the paths as given
        labels = [str(run.path) for run in runs]
    figure, ax = _figure(f"{metric} by run")
    for i, (run, label) in enumerate(zip(runs, labels)):
        steps, values = metric_series(run.metrics, metric)
        if not np.isfinite(values).any():
            known = sorted({k for r in run.metrics for k in r} - {"step"})
            raise DataError(f"{run.path} has no value of metric {metric!r}; it logged: {', '.join(known)}")
        _draw_series(ax, steps, values, COLORS[i % len(COLORS)], label=label)
    ax.legend(frameon=False, fontsize=9)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(_png(figure))
    return out


# ---- the page -------------------------------------------------------------------------------------

STYLE = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2328;
       max-width: 1320px; margin: 0 auto; padding: 24px 32px 64px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 36px 0 12px; padding-bottom: 4px; border-bottom: 1px solid #d0d7de; }
h3 { font-size: 16px; margin: 20px 0 8px; }
.sub { color: #59636e; margin: 0 0 16px; }
.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 0; }
.facts dt { color: #59636e; }
.facts dd { margin: 0; }
.notes { background: #fff8c5; border: 1px solid #d4a72c66; border-radius: 6px; padding: 8px 16px; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 16px; }
figure { margin: 0; border: 1px solid #d0d7de; border-radius: 6px; padding: 8px; }
figure img { width: 100%; height: auto; display: block; }
figcaption { color: #59636e; font-size: 13px; padding: 4px 4px 0; }
table { border-collapse: collapse; margin: 4px 0 12px; }
th, td { border: 1px solid #d0d7de; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
pre { margin: 0; white-space: pre-wrap; word-break: break-word; font: 13px/1.4 ui-monospace, Menlo, Consolas, monospace;
      max-width: 640px; }
summary { cursor: pointer; color: #0969da; margin: 8px 0; }
.good { color: #1a7f37; }
.bad { color: #cf222e; }
"""


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _pre(text: Any) -> str:
    return f"<pre>{_esc(text)}</pre>"


def _number(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}g}" if isinstance(value, float) else _esc(value)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    """An HTML table; cells are already-escaped HTML fragments (a cell starting with '#' is right-aligned)."""
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="num">{c[1:]}</td>' if c.startswith("#") else f"<td>{c}</td>"
                                    for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _facts(run: Run) -> str:
    summary, config = run.summary or {}, run.config or {}
    facts = [("model", summary.get("model") or config.get("model")),
             ("dataset", summary.get("dataset") or config.get("dataset")),
             ("reward functions", ", ".join(run.reward_functions) or None),
             ("optimizer steps", summary.get("steps", f"{run.metrics[-1]['step']} logged (unfinished)")),
             ("loss type", config.get("loss_type"))]
    return '<dl class="facts">' + "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in facts if v is not None) \
        + "</dl>"


def _evaluation(run: Run) -> str:
    summary = run.summary or {}
    before, after = summary.get("before"), summary.get("after")
    if not (before and after):
        return "<p>No before/after evaluation in this run.</p>"
    rows = [[label, *("#" + cell for cell in cells)] for label, *cells in before_after_rows(before, after)]
    return _table(["held-out (greedy)", "accuracy", "mean reward", "n"], rows)


def _evaluation_samples(run: Run) -> str:
    samples = (run.summary or {}).get("eval_samples") or {}
    pairs = list(zip(samples.get("before", []), samples.get("after", [])))
    if not pairs:
        return ""

    def mark(sample: dict) -> str:
        return '<span class="good">correct</span>' if sample.get("correct") else '<span class="bad">wrong</span>'

    rows = [[_pre(prompt_text(b.get("prompt", ""))), mark(b) + _pre(b.get("completion", "")),
             mark(a) + _pre(a.get("completion", ""))] for b, a in pairs]
    return "<h2>Held-out samples, before and after training</h2>" + _table(["prompt", "before", "after"], rows)


def _completions_at(run: Run, step: Any, label: str) -> str:
    records = [r for r in run.completions if r.get("step") == step]
    shown = records[:SAMPLES_PER_STEP]
    names = list(shown[0].get("rewards") or {})
    rows, previous = [], None
    for record in shown:
        prompt = prompt_text(record.get("prompt", ""))
        scores = [f"#{_number((record.get('rewards') or {}).get(n))}" for n in names]
        advantage = record.get("advantage")
        rows.append(["" if prompt == previous else _pre(prompt), _pre(record.get("completion", "")), *scores,
                     f"#{_number(record.get('reward'))}",
                     "#–" if advantage is None else f"#{advantage:+.3f}", _esc(record.get("finish_reason", ""))])
        previous = prompt
    heading = f"<h3>{_esc(label)}: step {_esc(step)} ({len(shown)} of {len(records)} completions)</h3>"
    return heading + _table(["prompt", "completion", *names, "total", "advantage", "finish"], rows)


def _samples(run: Run) -> str:
    steps = [r["step"] for r in run.completions if "step" in r]
    if not steps:
        return "<p>No completions were recorded.</p>"
    first, last = min(steps), max(steps)
    if first == last:
        return _completions_at(run, first, "Only recorded step")
    return _completions_at(run, first, "First recorded step") + _completions_at(run, last, "Last recorded step")


def _resumed_with_changes(path: Path, config: dict | None) -> list[str]:
    """A note for each config.resumed-at-N.yaml (a resume with changed settings): what changed, and when."""
    notes = []
    for step, resumed in resumed_configs(path):
        try:
            later = yaml.safe_load(resumed.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            notes.append(f"{resumed.name} could not be read ({type(e).__name__})")
            continue
        if isinstance(later, dict) and isinstance(config, dict):
            changed = [f"{key} {config.get(key)!r} -> {value!r}" for key, value in later.items()
                       if config.get(key) != value and key not in RESUME_FIELDS]
            notes.append(f"resumed at step {step} with changed settings: {'; '.join(changed) or 'none'} "
                         "(the config below is the first one)")
    return notes


def _config(run: Run) -> str:
    """The fields set away from their defaults, then every field (folded away: there are about a hundred)."""
    if run.config is None:
        return "<p>No config.yaml in the run folder.</p>"

    def value(v: Any) -> str:
        return _pre(v if isinstance(v, str) else json.dumps(v))

    defaults = GRPOConfig().to_dict()
    changed = [[f"<code>{_esc(k)}</code>", value(v), value(defaults[k]) if k in defaults else "–"]
               for k, v in run.config.items() if k not in defaults or defaults[k] != v]
    every = [[f"<code>{_esc(k)}</code>", value(v)] for k, v in run.config.items()]
    return (_table(["field set in this run", "value", "default"], changed)
            + f"<details><summary>All {len(every)} fields</summary>{_table(['field', 'value'], every)}</details>")


def _figure_html(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    caption = f"{plot.panel.key}: first {_number(plot.first, 4)}, last {_number(plot.last, 4)}"
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{_esc(plot.panel.title)}">'
            f"<figcaption>{_esc(caption)}</figcaption></figure>")


def _health(run: Run) -> str:
    """The verdict of covey diagnose and its evidence (diagnose.py), over the run's metrics and completions."""
    from covey.telemetry.diagnose import RunData, diagnose, diagnosis_html

    return diagnosis_html(diagnose(RunData(run.path, "covey", run.metrics, run.completions, summary=run.summary)))


def render_page(run: Run, plots: list[Plot]) -> str:
    """The whole report as one HTML document with no external resources and no scripts."""
    notes = "".join(f"<li>{_esc(n)}</li>" for n in run.notes)
    drawn = {plot.panel.name for plot in plots}
    absent = ", ".join(panel.key for panel in panels(run) if panel.name not in drawn)
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">', GENERATOR,
        f"<title>covey report: {_esc(run.path.name or run.path)}</title><style>{STYLE}</style></head><body>",
        f"<h1>covey run report</h1><p class=\"sub\">{_esc(run.path)}</p>", _facts(run),
        f'<h2>Notes on this run</h2><ul class="notes">{notes}</ul>' if notes else "",
        "<h2>Held-out evaluation</h2>", _evaluation(run), _health(run), probes_html(run.path),
        "<h2>Training curves</h2>",
        f'<div class="plots">{"".join(_figure_html(p) for p in plots)}</div>',
        f'<p class="sub">Not logged in this run, so not plotted: {_esc(absent)}</p>' if absent else "",
        _evaluation_samples(run),
        "<h2>Sample completions during training</h2>", _samples(run),
        "<h2>Config</h2>", _config(run),
        "</body></html>",
    ]
    return "\n".join(part for part in parts if part) + "\n"
