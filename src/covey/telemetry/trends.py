"""Robust trend statistics over a run's metric history, so that one noisy step fires nothing.

A history is a list of metric dicts (TRL's names, one per logged step, with ``step``). The rules of
hacking.py read it through these: a metric's finite values, the mean of a window at either end, the
noise of a series (from the median of its step-to-step changes, which a trend or one outlier barely
moves), whether a series clearly rose or fell between its first and last windows, and rank correlation.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

WINDOW = 4  # logged steps averaged at each end of a series
Z = 2.5  # a change counts when it exceeds this many standard errors of the difference of two window means
NOISE_FLOOR = 1e-6  # the least noise assumed (a series with no scatter at all)


def series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` where it is a finite number."""
    steps, values = [], []
    for i, h in enumerate(history):
        v = h.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(int(h.get("step", i + 1)))
            values.append(float(v))
    return steps, values


def noise(values: list[float]) -> float:
    """Robust standard deviation of one value around the trend: the median absolute deviation of the
    step-to-step changes (scaled to a normal's sigma), over sqrt(2) as each change holds two values' noise."""
    if len(values) < 3:
        return NOISE_FLOOR
    diffs = [b - a for a, b in zip(values, values[1:])]
    centre = statistics.median(diffs)
    mad = statistics.median(abs(d - centre) for d in diffs)
    return max(1.4826 * mad / math.sqrt(2), NOISE_FLOOR)


def smooth(values: list[float], n: int = WINDOW) -> list[float]:
    """The trailing mean of up to ``n`` values at each point."""
    return [statistics.fmean(values[max(0, i - n + 1):i + 1]) for i in range(len(values))]


@dataclass(frozen=True)
class Change:
    """How a series moved from its first window to its last."""
    first: float
    last: float
    error: float  # standard error of last - first

    @property
    def delta(self) -> float:
        return self.last - self.first

    @property
    def rose(self) -> bool:
        return self.delta > Z * self.error

    @property
    def fell(self) -> bool:
        return self.delta < -Z * self.error


def change(values: list[float], n: int = WINDOW) -> Change | None:
    """First-window mean, last-window mean and the standard error of their difference; None with fewer
    than 2 * ``n`` values (the two windows would overlap)."""
    if len(values) < 2 * n:
        return None
    sigma = noise(values)
    return Change(statistics.fmean(values[:n]), statistics.fmean(values[-n:]), sigma * math.sqrt(2 / n))


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two equally long series (0 where either is constant)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    if len(a) < 3:
        return 0.0
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    sa = math.sqrt(sum((x - ma) ** 2 for x in ra))
    sb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return 0.0 if sa == 0 or sb == 0 else sum((x - ma) * (y - mb) for x, y in zip(ra, rb)) / (sa * sb)


def onset(steps: list[int], values: list[float], rising: bool, n: int = WINDOW) -> int:
    """The step where a move began: the last step at which the smoothed series was at its extreme
    against the move (its lowest before a rise, its highest before a fall)."""
    smoothed = smooth(values, n)
    pick = min if rising else max
    best = pick(smoothed)
    return steps[max(i for i, v in enumerate(smoothed) if v == best)] if smoothed else 0


def binomial_error(p1: float, n1: int, p2: float, n2: int) -> float:
    """Standard error of p2 - p1 for two shares (accuracies) of n1 and n2 trials under no change: the pooled
    share's binomial variance over both sizes."""
    pooled = (p1 * n1 + p2 * n2) / (n1 + n2)
    return math.sqrt(max(pooled * (1 - pooled), 0.0) * (1 / n1 + 1 / n2))
