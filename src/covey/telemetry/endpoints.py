"""The held-out evaluations at the two ends of a run: before training and after it.

covey evaluates the held-out set before the first step and after the last (summary.json's ``before`` and
``after``: accuracy, mean reward, and ``checked``, the problems whose answer could be checked), beside the
evaluations during training that metrics.jsonl holds. ``covey diagnose`` reads the evaluation after training
as the run's final held-out point, and weighs the end of the run: held-out accuracy clearly above where it
began (by HELDOUT_ACCURACY_GAIN and by more than the held-out set's size allows by chance) contradicts a
finding that the reward was gamed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from covey.telemetry.hacking import HELDOUT_ACCURACY_GAIN
from covey.telemetry.trends import Z, binomial_error, series

HELDOUT_KEYS = {"accuracy": "eval/accuracy", "mean_reward": "eval/mean_reward"}


def _number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def with_sizes(history: list[dict], summary: dict | None) -> list[dict]:
    """The history with the held-out set's size (``eval/checked``) on every evaluation that lacks it (runs that
    did not log it): covey evaluates the same held-out rows each time, so the size summary.json gives is
    theirs. The rows given are not changed."""
    before, after = ((summary or {}).get(k) or {} for k in ("before", "after"))
    checked = next((int(n) for n in (after.get("checked"), before.get("checked")) if (_number(n) or 0) >= 1), None)
    if checked is None:
        return history
    return [{**row, "eval/checked": checked} if _number(row.get("eval/accuracy")) is not None
            and "eval/checked" not in row else row for row in history]


def with_final(history: list[dict], summary: dict | None) -> list[dict]:
    """The history (with its held-out sizes, see with_sizes) and the evaluation after training (summary.json's
    ``after``) as the held-out point of its last logged step, where that step holds no evaluation of its own."""
    after = (summary or {}).get("after") or {}
    final = {key: v for name, key in HELDOUT_KEYS.items() if (v := _number(after.get(name))) is not None}
    rows = list(history)
    if rows and final and not any(_number(rows[-1].get(key)) is not None for key in HELDOUT_KEYS.values()):
        rows[-1] = {**rows[-1], **final}
    return with_sizes(rows, summary)


@dataclass(frozen=True)
class HeldoutEnds:
    """Held-out accuracy where the run began and where it ended, the best between, and the sizes of the
    held-out sets at either end where they are known (None: not known, as in a TRL log)."""
    start: float
    end: float
    best: float
    n_start: int | None
    n_end: int | None

    @property
    def error(self) -> float | None:
        """Standard error of end - start under no change (the two evaluations' pooled binomial)."""
        if not self.n_start or not self.n_end:
            return None
        return binomial_error(self.start, self.n_start, self.end, self.n_end)

    @property
    def gained(self) -> bool:
        """The run ended clearly above where it began and near its best: a gain of HELDOUT_ACCURACY_GAIN or more,
        more than Z standard errors where the sizes are known, and within HELDOUT_ACCURACY_GAIN of the best."""
        gain, error = self.end - self.start, self.error
        return (gain >= HELDOUT_ACCURACY_GAIN and self.end >= self.best - HELDOUT_ACCURACY_GAIN
                and (error is None or gain > Z * error))

    def text(self) -> str:
        sizes = f" (n={self.n_start} and {self.n_end})" if self.n_start and self.n_end else ""
        return f"held-out accuracy {self.start:.3f} -> {self.end:.3f}{sizes}"


def heldout_ends(history: list[dict], summary: dict | None) -> HeldoutEnds | None:
    """Held-out accuracy at the run's two ends: before training (summary.json) or else the first evaluation during
    it, and after training or else the last evaluation; None with fewer than two held-out accuracies."""
    before, after = ((summary or {}).get(k) or {} for k in ("before", "after"))
    _, during = series(history, "eval/accuracy")
    points = [v for v in (_number(before.get("accuracy")), *during, _number(after.get("accuracy"))) if v is not None]
    if len(points) < 2:
        return None
    evaluations = [h for h in history if _number(h.get("eval/accuracy")) is not None]
    # the sizes: summary.json's where its evaluation is the end, else the evaluation's own eval/checked
    n_start = _size(before.get("checked") if _number(before.get("accuracy")) is not None else
                    evaluations[0].get("eval/checked") if evaluations else None)
    n_end = _size(after.get("checked") if _number(after.get("accuracy")) is not None else
                  evaluations[-1].get("eval/checked") if evaluations else None)
    return HeldoutEnds(points[0], points[-1], max(points), n_start, n_end)


def _size(value) -> int | None:
    """A held-out set's size as logged (metrics are floats: 16.0), or None where it is not a count."""
    number = _number(value)
    return int(number) if number is not None and number >= 1 else None
