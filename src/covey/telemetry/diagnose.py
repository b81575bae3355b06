"""``covey diagnose``: the health and hacking rules over a run folder, covey's or TRL's, and one verdict.

A covey run folder has metrics.jsonl and completions.jsonl. A TRL output directory has
``trainer_state.json`` (at its top after ``trainer.save_state()``, else in its newest ``checkpoint-N/``)
whose ``log_history`` holds the logged metrics under the same names (evaluations as ``eval_<name>``),
and, with ``log_completions``, ``completions/completions_<step>.parquet``. Both are read into one form
(covey's names), so the same history gets the same verdict whichever trainer wrote it.
"""

from __future__ import annotations

import bisect
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from covey.errors import ConfigError
from covey.telemetry import endpoints, health
from covey.telemetry.hacking import MIN_STEPS, Finding, Monitor
from covey.telemetry.trends import WINDOW, change, series

LEARNING, NOT_LEARNING, GAMING, COLLAPSED, TOO_EARLY = (
    "learning", "not learning", "gaming the reward", "collapsed", "too early to tell")
GENERATOR = '<meta name="generator" content="covey diagnose">'  # marks a page as covey's to rewrite
REPLAY_POINTS = 500  # most prefixes of a history the rules are replayed over
BELIED = " (contradicted by the held-out gain at the end)"  # a gaming finding the end of the run belies
SPREAD_GONE = 0.01  # reward_std below this: every completion of a group scores the same


@dataclass
class RunData:
    folder: Path
    source: str  # covey or trl
    history: list[dict]
    samples: list[dict]
    notes: list[str] = field(default_factory=list)
    summary: dict | None = None  # a covey run's summary.json: the evaluations before and after training


@dataclass
class Diagnosis:
    verdict: str
    reason: str
    findings: list[tuple[int, Finding]]  # (the step covey warned at, the finding)
    warnings: list[tuple[int, str]]  # the one-metric health warnings: (step, message)
    notes: list[str]
    contradicted: list[str] = field(default_factory=list)  # keys of the gaming findings the end of the run belies

    def text(self) -> str:
        lines = [f"verdict: {self.verdict}: {self.reason}"]
        for step, finding in self.findings:
            belied = BELIED if finding.key in self.contradicted else ""
            lines.append(f"- step {step}{belied}: {finding.text()}")
        lines += [f"- step {step}: {message}" for step, message in self.warnings]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _jsonl(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut off by a run still writing
    return rows


def _trl_state(folder: Path) -> Path | None:
    if (folder / "trainer_state.json").exists():
        return folder / "trainer_state.json"
    checkpoints = [p for p in folder.glob("checkpoint-*/trainer_state.json")
                   if re.fullmatch(r"checkpoint-\d+", p.parent.name)]
    return max(checkpoints, key=lambda p: int(p.parent.name.split("-")[1])) if checkpoints else None


def trl_history(log_history: list[dict]) -> list[dict]:
    """TRL's log_history in covey's form: one dict per step, evaluations (``eval_reward``, ``eval_accuracy``,
    ``eval_<name>``) as ``eval/mean_reward``, ``eval/accuracy``, ``eval/<name>`` on their step's line."""
    by_step: dict[int, dict] = {}
    for entry in log_history:
        if "step" not in entry:
            continue
        row = by_step.setdefault(int(entry["step"]), {"step": int(entry["step"])})
        for key, value in entry.items():
            if key.startswith("eval_"):
                name = key[len("eval_"):]
                row[{"reward": "eval/mean_reward", "accuracy": "eval/accuracy"}.get(name, f"eval/{name}")] = value
            elif key != "step":
                row[key] = value
    return [row for _, row in sorted(by_step.items()) if "reward" in row or any(k.startswith("eval/") for k in row)]


def _message_text(value) -> str:
    """A completion or prompt as text: a string, or the last message's content of a conversation."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        return str(value[-1].get("content", ""))
    return value if isinstance(value, str) else str(value)


def trl_samples(folder: Path) -> tuple[list[dict], list[str]]:
    """The completions TRL wrote under ``completions/`` (one parquet file per logged step), as samples;
    a reward is the sum of the reward functions' columns (TRL's logs do not keep the weights)."""
    files = sorted((folder / "completions").glob("completions_*.parquet"))
    if not files:
        return [], ["no completions/ parquet files (TRL's log_completions was off): the text rules are skipped"]
    try:
        import pandas as pd
    except ImportError:
        return [], ["pandas is not installed, so TRL's completion logs are not read: pip install pandas pyarrow"]
    samples = []
    for path in files:
        frame = pd.read_parquet(path)
        rewards = [c for c in frame.columns if c not in ("step", "prompt", "completion", "advantage")
                   and pd.api.types.is_numeric_dtype(frame[c])]
        for record in frame.to_dict("records"):
            scores = [record[c] for c in rewards if record[c] == record[c]]  # NaN: the function did not apply
            samples.append({"step": int(record.get("step", 0)), "prompt": _message_text(record.get("prompt")),
                            "completion": _message_text(record.get("completion")),
                            "reward": float(sum(scores)) if scores else None})
    return samples, []


def read_run(folder: str | Path) -> RunData:
    """A covey run folder or a TRL output directory, finished or still running."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"covey diagnose: {folder} is not a folder; give a covey run folder (with metrics.jsonl) "
                          "or a TRL output_dir (with trainer_state.json)")
    if (folder / "metrics.jsonl").exists():
        samples = _jsonl(folder / "completions.jsonl") if (folder / "completions.jsonl").exists() else []
        notes = [] if samples else ["no completions.jsonl (log_completions off): the text rules are skipped"]
        summary = None
        if (folder / "summary.json").exists():
            try:
                summary = json.loads((folder / "summary.json").read_text())
            except ValueError:
                notes.append("summary.json is not valid JSON: the evaluations before and after training are not read")
        return RunData(folder, "covey", _jsonl(folder / "metrics.jsonl"), samples, notes, summary)
    if (state := _trl_state(folder)) is not None:
        try:
            log_history = json.loads(state.read_text()).get("log_history", [])
        except ValueError as e:
            raise ConfigError(f"covey diagnose: {state} is not valid JSON ({e})") from e
        samples, notes = trl_samples(folder)
        if state.parent != folder:
            notes.append(f"read {state.relative_to(folder)} (no trainer_state.json at the top: the history ends "
                         "at that checkpoint)")
        return RunData(folder, "trl", trl_history(log_history), samples, notes)
    raise ConfigError(f"covey diagnose: {folder} holds neither metrics.jsonl (a covey run folder) nor "
                      "trainer_state.json (a TRL output_dir, at its top or in a checkpoint-N folder); give the "
                      "folder a run wrote to")


def replay(history: list[dict], samples: list[dict]) -> tuple[list[tuple[int, Finding]], list[tuple[int, str]]]:
    """The rules over the history as it grew, as during the run: each finding and warning with the step it
    first showed (samples recorded up to that step). A history longer than REPLAY_POINTS logged steps is
    replayed at every k-th step (k = its length // REPLAY_POINTS), so a step may be up to k - 1 late."""
    samples = sorted(samples, key=lambda s: s.get("step", 0))
    sample_steps = [s.get("step", 0) for s in samples]
    monitor, warned = Monitor(), health.HealthMonitor(hacking=False)
    found, warnings = [], []
    stride = max(1, len(history) // REPLAY_POINTS)
    for i in [*range(1, len(history), stride), len(history)]:
        step = history[i - 1].get("step", i)
        so_far = samples[:bisect.bisect_right(sample_steps, step)]
        found += [(step, f) for f in monitor.check(history[:i], so_far)]
        warnings += [(step, m) for m in warned.check(history[:i]) if "loss near 0" not in m]
    return found, warnings


def _why_not_learning(history: list[dict]) -> str:
    _, spread = series(history, "reward_std")
    _, same = series(history, "frac_reward_zero_std")
    _, clipped = series(history, "completions/clipped_ratio")
    if spread and max(spread) < SPREAD_GONE:
        return ("every completion got the same reward in every logged step (reward_std 0): there is nothing to "
                "learn from; check that the reward varies between completions (covey verify)")
    if same and statistics.fmean(same[-WINDOW:]) > 0.5:
        return ("over half of the groups scored alike in the last logged steps, so most get no advantage: a reward "
                "too harsh (or a task already solved); give partial credit or raise num_generations")
    if clipped and statistics.fmean(clipped[-WINDOW:]) > 0.5:
        return "most completions are cut at max_completion_length: raise it, or reward shorter answers"
    return ("the reward is not clearly above where it started; try a higher learning rate or a reward with partial "
            "credit")


def diagnose(run: RunData) -> Diagnosis:
    """The rules replayed over the run (with the evaluation after training as its final held-out point), and one
    verdict that weighs the end of the run: gaming findings belied by a clear held-out accuracy gain at the end
    are reported as contradicted, and do not make the verdict."""
    history = endpoints.with_final(run.history, run.summary)
    found, warnings = replay(history, run.samples)
    notes = list(run.notes) + [f"{f.message.removeprefix('note: ')}: {f.advice}" for _, f in found if f.kind == "note"]
    found = [(s, f) for s, f in found if f.kind != "note"]
    _, rewards = series(run.history, "reward")
    moved = change(rewards)

    def verdict(name: str, reason: str, contradicted: list[str] = ()) -> Diagnosis:
        return Diagnosis(name, reason, found, warnings, notes, list(contradicted))

    if len(rewards) < MIN_STEPS or moved is None:
        return verdict(TOO_EARLY, f"{len(rewards)} logged steps with a reward; the rules need {MIN_STEPS}")
    ends = endpoints.heldout_ends(run.history, run.summary)
    gained = ends is not None and ends.gained
    gaming = [f for _, f in found if f.kind == "gaming"]
    if gaming and not gained:
        return verdict(GAMING, "; ".join(f.message for f in gaming[:2]))
    belied = [f.key for f in gaming]
    but = (f"; {len(belied)} gaming finding(s) ({', '.join(belied)}) contradicted by the held-out gain at the end"
           if belied else "")
    collapse = [f for _, f in found if f.kind == "collapse"]
    _, spread = series(run.history, "reward_std")
    if collapse:
        return verdict(COLLAPSED, collapse[0].message + but, belied)
    if (not moved.rose and len(spread) >= 2 * WINDOW and max(spread[-WINDOW:]) < SPREAD_GONE
            and statistics.fmean(spread[:WINDOW]) > 5 * SPREAD_GONE):
        return verdict(COLLAPSED, f"reward_std fell to 0 while the reward did not rise ({moved.first:.3f} -> "
                       f"{moved.last:.3f}): every completion now scores the same{but}", belied)
    if moved.fell:
        return verdict(NOT_LEARNING, f"the reward fell {moved.first:.3f} -> {moved.last:.3f}: the updates make the "
                       f"policy worse; lower the learning rate{but}", belied)
    if not moved.rose and not gained:
        held = "" if ends is None else f"; {ends.text()}, not a clear gain"
        return verdict(NOT_LEARNING, _why_not_learning(run.history) + f" (reward {moved.first:.3f} -> "
                       f"{moved.last:.3f}){held}")
    if not moved.rose:
        return verdict(LEARNING, f"{ends.text()} at the end, though the training reward is not clearly above its "
                       f"start ({moved.first:.3f} -> {moved.last:.3f}){but}", belied)
    if ends is not None:
        also = f", {ends.text()}"
    else:
        held = series(history, "eval/mean_reward")[1]
        also = f", held-out mean reward {held[0]:.3f} -> {held[-1]:.3f}" if len(held) >= 2 else ""
    return verdict(LEARNING, f"the reward rose {moved.first:.3f} -> {moved.last:.3f}{also}{but}", belied)


def diagnosis_html(diagnosis: Diagnosis) -> str:
    """The verdict and its evidence as a section of the report page."""
    from html import escape

    items = [f"<li><b>step {step}</b>{BELIED if f.key in diagnosis.contradicted else ''}: {escape(f.message)}"
             f"{'' if f.began is None else f' (from step {f.began})'}. "
             f"{escape(f.advice)}" + "".join(f"<br><code>{escape(e)}</code>" for e in f.examples) + "</li>"
             for step, f in diagnosis.findings]
    items += [f"<li><b>step {step}</b>: {escape(message)}</li>" for step, message in diagnosis.warnings]
    items += [f"<li>{escape(note)}</li>" for note in diagnosis.notes]
    return (f"<h2>Health: {escape(diagnosis.verdict)}</h2><p>{escape(diagnosis.reason)}</p>"
            + (f"<ul>{''.join(items)}</ul>" if items else ""))


def standalone_page(run: RunData, diagnosis: Diagnosis, out_dir: Path) -> Path:
    """A page with the diagnosis alone (a TRL folder, which covey report does not draw): ``out_dir``/diagnosis.html."""
    from html import escape

    page = out_dir / "diagnosis.html"
    if page.exists() and GENERATOR not in page.read_text(errors="replace"):
        raise ConfigError(f"{page} exists and is not covey's: pass --out with another folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    page.write_text(f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">{GENERATOR}<title>covey diagnose: '
                    f"{escape(run.folder.name)}</title></head><body><h1>covey diagnose</h1>"
                    f"<p>{escape(str(run.folder))} "
                    f"({run.source})</p>{diagnosis_html(diagnosis)}</body></html>\n", encoding="utf-8")
    return page
