"""The reward probes run before the first step (reward_probes.json in a run folder) as a section of the run
report: what fooled which reward function, with an example, or that nothing did."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

FILE = "reward_probes.json"  # written by covey.train.reward_probing


def probes_html(run_dir: Path) -> str:
    """The section, or "" for a run that did not probe its rewards (reward_probes: false, or an older run)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return ""
    try:
        data = json.loads(path.read_text())
        findings, notes = list(data["findings"]), list(data.get("notes", []))
        against = f"against {data['yardstick']}, on {data['rows']} training row(s)"
    except (ValueError, KeyError, TypeError) as e:
        return f"<h2>Reward probes</h2><p>{escape(FILE)} could not be read ({escape(type(e).__name__)})</p>"
    items = [f"<li><b>{escape(str(f['reward']))}</b> is fooled by {escape(str(f['what']))} ({escape(str(f['probe']))}): "
             f"{f['score']:.3g} against {f['yardstick']:.3g}. {escape(str(f['advice']))}"
             f"<br><code>{escape(str(f['example']))}</code></li>" for f in findings]
    items += [f"<li>{escape(str(note))}</li>" for note in notes]
    verdict = (f'<p class="bad">{len(findings)} finding(s) before the first step, {escape(against)}: a completion '
               "that does not solve the task scores as high as one that does</p>" if findings else
               f"<p>No reward function was fooled by a probe, {escape(against)}.</p>")
    return "<h2>Reward probes</h2>" + verdict + (f"<ul>{''.join(items)}</ul>" if items else "")
