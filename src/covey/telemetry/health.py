"""Plain-language health warnings from the metric history of a run.

Each rule looks at the logged metrics (dicts with TRL's names) and returns a warning with the
likely cause and a fix, or None. The monitor shows each kind of warning once per run.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

from covey.telemetry.hacking import Monitor

WINDOW = 5  # logged steps a trend must hold before it is reported
NO_RISE_AFTER = 30  # logged steps after which a mean reward not clearly above the start's is reported


@dataclass(frozen=True)
class HealthWarning:
    key: str
    message: str


def _last(history: list[dict], key: str, n: int = WINDOW) -> list[float] | None:
    values = [h[key] for h in history[-n:] if isinstance(h.get(key), (int, float))]
    return values if len(values) == n else None


def reward_collapse(history):
    values = _last(history, "reward_std")
    if values and max(values) < 0.01:
        return HealthWarning("reward_std", f"reward_std has stayed below 0.01 for {WINDOW} logged steps: every completion "
                        "gets the same reward, so there is nothing to learn from. Likely the policy collapsed to one "
                        "answer or the reward is too harsh; raise the temperature, make the reward incremental "
                        "(partial credit), or lower the learning rate.")


def high_kl(history):
    if "kl" in history[-1] and history[-1]["kl"] is None:  # logged as null: NaN or infinite
        return HealthWarning("kl", "KL to the reference is not finite: the policy's or the reference's log-probs "
                             "broke down. Lower the learning rate, or check the model's numerics (bf16).")
    kl = history[-1].get("kl")
    if isinstance(kl, (int, float)) and kl > 0.5:
        return HealthWarning("kl", f"KL to the reference is {kl:.2f} (> 0.5): the policy is drifting far from where it "
                        "started. Lower the learning rate or raise beta.")


def flat_reward(history):
    """The reward has not moved at all; or, after ``NO_RISE_AFTER`` logged steps, the mean of the last
    ``2 * WINDOW`` has fallen below the mean of the first ``2 * WINDOW``, or is not above it, by more
    than twice their noise (the standard error of the difference). A flat reward whose groups are
    mostly constant (a task already solved, or a reward too harsh) is left to ``constant_groups``."""
    check = "covey verify checks the pipeline, covey generate shows the rewards of sampled completions"
    values = _last(history, "reward", 2 * WINDOW)
    if values and max(values) - min(values) < 1e-6:
        return HealthWarning("reward", f"the mean reward has not moved in {2 * WINDOW} logged steps: check that the "
                             f"rewards vary between completions ({check}).")
    rewards = [h["reward"] for h in history if isinstance(h.get("reward"), (int, float))]
    if len(rewards) < NO_RISE_AFTER:
        return None
    first, last = statistics.fmean(rewards[:2 * WINDOW]), statistics.fmean(rewards[-2 * WINDOW:])
    noise = 2 * math.sqrt((statistics.variance(rewards[:2 * WINDOW]) + statistics.variance(rewards[-2 * WINDOW:]))
                          / (2 * WINDOW))
    where = (f"{first:.3f} over the first {2 * WINDOW} logged steps, {last:.3f} over the last {2 * WINDOW}, "
             f"noise +-{noise:.3f}")
    if last - first < -noise:
        return HealthWarning("reward", f"after {len(rewards)} logged steps the mean reward has fallen ({where}): the "
                             f"updates are making the policy worse. Lower the learning rate and watch kl ({check}).")
    constant = _last(history, "frac_reward_zero_std", 2 * WINDOW)
    if last - first <= noise and not (constant and statistics.fmean(constant) > 0.5):
        return HealthWarning("reward", f"after {len(rewards)} logged steps the mean reward is not clearly above where "
                             f"it started ({where}). Try a higher learning rate or a reward that gives partial "
                             f"credit ({check}).")


def sustained_above(key: str, threshold: float, steps: int, message: str) -> Callable[[list[dict]], HealthWarning | None]:
    """A rule that fires when ``key`` stayed above ``threshold`` in each of the last ``steps`` logged steps."""
    def rule(history):
        values = _last(history, key, steps)
        if values and min(values) > threshold:
            return HealthWarning(key, message)
    return rule


constant_groups = sustained_above(
    "frac_reward_zero_std", 0.5, 3, "over half of the groups had identical rewards in each of the last 3 logged "
    "steps; those groups give zero advantage. Try a larger num_generations, a softer reward, or dynamic_sampling: true.")
truncation = sustained_above(
    "completions/clipped_ratio", 0.5, 3, "over half of the completions hit max_completion_length in each of the last "
    "3 logged steps: their rewards judge cut-off text. Raise max_completion_length, or penalise length "
    "(soft_overlong_penalty) / mask_truncated_completions: true.")


def trainer_waits(history):
    """Under async_generation: the trainer waited for the worker over half of each of the last 3 logged steps."""
    recent = [h for h in history[-3:] if isinstance(h.get("time/wait_for_data"), (int, float)) and h.get("step_time")]
    if len(recent) == 3 and all(h["time/wait_for_data"] > 0.5 * h["step_time"] for h in recent):
        return HealthWarning("time/wait_for_data", "the trainer waited for sampled rounds over half of each of the "
                             "last 3 logged steps: generation is the slower side, so asynchronous generation gains "
                             "little. Sample less per round (shorter max_completion_length, fewer generations), give "
                             "the worker a faster engine, or let it run further ahead (a larger max_staleness).")


most_rows_stale = sustained_above(
    "async/dropped_fraction", 0.5, 1, "over half of the rows sampled ahead were dropped as staler than max_staleness: "
    "the worker samples with weights too old for the bound. Raise max_staleness, or use async_schedule: fixed, "
    "which never samples staler than the bound.")


def loss_near_zero(history):
    if len(history) == 1:
        return HealthWarning("loss-info", "note: a GRPO loss near 0 is expected (advantages are centred within each "
                        "group, and the ratio starts at 1); watch reward and reward_std instead.")


RULES: list[Callable[[list[dict]], HealthWarning | None]] = [
    loss_near_zero, reward_collapse, constant_groups, high_kl, flat_reward, truncation, trainer_waits, most_rows_stale]


class HealthMonitor:
    """Collects the warnings the rules raise, each kind once per run; with ``hacking``, also the findings of
    hacking.py over the run's recorded completions (reward hacking and collapse, with their evidence).
    ``keys`` names what the last check raised (logged as ``health/<key>`` metrics)."""

    def __init__(self, hacking: bool = True) -> None:
        self.shown: set[str] = set()
        self.hacking = Monitor() if hacking else None
        self.keys: list[str] = []

    def resume(self, history: list[dict]) -> None:
        """A resumed run: the warnings its history logged (``health/<key>``) were shown, and are not again."""
        keys = {name.removeprefix("health/") for entry in history for name in entry if name.startswith("health/")}
        self.shown |= keys
        if self.hacking:
            self.hacking.shown |= keys

    def check(self, history: list[dict], samples: list[dict] = ()) -> list[str]:
        messages, self.keys = [], []
        for rule in RULES:
            warning = rule(history)
            if warning and warning.key not in self.shown:
                self.shown.add(warning.key)
                messages.append(warning.message)
                self.keys.append(warning.key)
        for finding in self.hacking.check(history, samples) if self.hacking else ():
            messages.append(finding.text())
            self.keys.append(finding.key)
        return messages
