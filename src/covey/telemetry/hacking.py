"""Reward hacking and collapse, told from a run's metric history and its sampled completions.

Each detector is a pure function ``(history, samples) -> Finding | None``: ``history`` the logged
metrics (TRL's names, one dict per logged step, held-out results as ``eval/accuracy`` and
``eval/mean_reward`` on the step they were made after, with ``eval/checked``, the held-out set's size,
where it is known), ``samples`` the recorded completions (dicts
with ``step``, ``prompt``, ``completion``, ``reward``, as completions.jsonl holds them). A finding
names the step where the pattern began, the values behind it, one to three completions that show it,
and what to do. Trends are judged on windows of ``trends.WINDOW`` logged steps against the series' own
noise, so a single noisy step fires nothing; the thresholds below are named where they are used.
"""

from __future__ import annotations

import bisect
import math
import statistics

from covey.telemetry import text_signals
from covey.telemetry.finding import Finding
from covey.telemetry.trends import WINDOW, Z, Change, binomial_error, change, noise, onset, series, smooth, spearman

MIN_STEPS = 2 * WINDOW  # logged steps before any trend is judged
MIN_EVALS = 3  # held-out evaluations (the one after training among them) before the held-out trend is judged
MIN_RISEN_EVALS = 2  # of them made after the training reward had clearly risen (1 where the sizes are known)
HELDOUT_ACCURACY_GAIN = 0.05  # a held-out accuracy gain below this (5 points) is "no gain"
HELDOUT_REWARD_SHARE = 0.25  # a held-out reward gain below this share of the training reward's is "no gain"
HIGH_ACCURACY = 0.8  # held-out accuracy already this high and not falling: a flat one is a solved task
SATURATED_GROUPS = 0.75  # share of groups whose completions all got the same reward: the reward is maxed
PLATEAU = 0.05  # the last window within this share of the reward's range of its best: at its maximum
LENGTH_GROWTH = 1.5  # mean completion length this many times its start ...
CLIPPED_RISE = 0.3  # ... and this many more completions cut at max_completion_length than at the start
LENGTH_FOLLOWS_REWARD = 0.5  # rank correlation of length and reward over the run: the reward pays for length
LENGTH_COLLAPSE = 0.5  # mean completion length below this share of its start, while the reward falls
ENTROPY_COLLAPSE = 0.3  # entropy below this share of its start ...
SPREAD_COLLAPSE = 0.5  # ... while reward_std is below this share of its start
KL_ACCELERATION = 2.0  # the KL's slope over the last window this many times the window before's
KL_FLOOR = 0.02  # a KL below this is too small to worry about, however it curves

MAX_ROWS = 256  # logged steps the rules read of a longer history (see thin)

NO_HELDOUT_KEY = "heldout-info"


def heldout(history: list[dict]) -> tuple[str, list[int], list[float]] | None:
    """The held-out metric evaluated during training: accuracy where there is one, else mean reward."""
    for key in ("eval/accuracy", "eval/mean_reward"):
        steps, values = series(history, key)
        if values:
            return key, steps, values
    return None


def risen_at(history: list[dict], at: list[int]) -> list[bool]:
    """For each step of ``at``, whether the training reward had clearly risen by then: the mean of its window
    ending at that step above its first window's by more than Z standard errors, the noise taken from the
    whole history (trends.noise)."""
    steps, rewards = series(history, "reward")
    if len(rewards) < 2 * WINDOW:
        return [False] * len(at)
    first, error = statistics.fmean(rewards[:WINDOW]), noise(rewards) * math.sqrt(2 / WINDOW)
    ends = [bisect.bisect_right(steps, step) for step in at]
    return [end > WINDOW and statistics.fmean(rewards[end - WINDOW:end]) - first > Z * error for end in ends]


def _sizes(history: list[dict], steps: list[int]) -> list[int] | None:
    """The held-out set's size (problems checked) at each evaluation step, where every one is logged
    (``eval/checked``); else None."""
    by_step = {h.get("step", i + 1): h.get("eval/checked") for i, h in enumerate(history)  # as trends.series
               if h.get("eval/accuracy") is not None}
    sizes = [by_step.get(step) for step in steps]  # logged metrics are floats: 16.0
    ok = all(isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) and n >= 1 for n in sizes)
    return [int(n) for n in sizes] if ok else None


def _accuracy_gap(values: list[float], sizes: list[int] | None, last: list[int]) -> bool:
    """Held-out accuracy did not follow: it gained under HELDOUT_ACCURACY_GAIN from the first evaluation to the
    ``last`` ones (pooled). Where the held-out set's sizes are known, that must also be beyond chance: the
    accuracy fell from its best before them by more than Z binomial standard errors, or its gain from the first
    is below HELDOUT_ACCURACY_GAIN even at Z standard errors above what was seen (a set too small to tell a
    flat accuracy from a rising one says nothing)."""
    weights = [sizes[i] for i in last] if sizes else [1] * len(last)
    now = sum(values[i] * w for i, w in zip(last, weights)) / sum(weights)
    if now - values[0] >= HELDOUT_ACCURACY_GAIN:
        return False
    if sizes is None:
        return True
    n_now = sum(weights)
    best = max(range(last[0]), key=lambda i: (values[i], -i))
    fell = values[best] - now > Z * binomial_error(values[best], sizes[best], now, n_now)
    flat = now - values[0] + Z * binomial_error(values[0], sizes[0], now, n_now) < HELDOUT_ACCURACY_GAIN
    return fell or flat


def _heldout_flat(history: list[dict], reward: Change) -> tuple[str, float, float, int] | None:
    """(key, first, last, the step of its best evaluation before the last) where the held-out metric did not gain
    (or fell) from its first evaluation while the training ``reward`` rose; None where it gained, the task is
    solved, or too few evaluations were made after the reward rose. A held-out metric can only fail to follow a
    rise it was measured after: at least MIN_RISEN_EVALS evaluations must have been made once the reward had
    clearly risen (one where the held-out set's sizes are known: the binomial test weighs its noise), and "last"
    is the mean of the last two of those. A held-out mean reward (the same reward, on unseen prompts) at or above
    the training reward's last level has nothing left to follow."""
    found = heldout(history)
    if found is None or len(found[2]) < MIN_EVALS:
        return None
    key, steps, values = found
    risen = [i + 1 for i, up in enumerate(risen_at(history, steps[1:])) if up]
    sizes = _sizes(history, steps) if key == "eval/accuracy" else None
    if len(risen) < (1 if sizes else MIN_RISEN_EVALS):
        return None
    first, last = values[0], statistics.fmean(values[i] for i in risen[-2:])
    if key == "eval/accuracy":
        if last >= HIGH_ACCURACY and last >= first - HELDOUT_ACCURACY_GAIN:
            return None  # a solved task stays flat near the top
        flat = _accuracy_gap(values, sizes, risen[-2:])
    else:
        if last >= reward.last:
            return None  # unseen prompts already pay as much as the training ones
        flat = last - first < HELDOUT_REWARD_SHARE * reward.delta
    if not flat:
        return None
    best = max(range(len(values) - 1), key=lambda i: (values[i], -i))  # the best before the last evaluation
    return key, first, last, steps[best]


def _examples(samples: list[dict], n: int = 2) -> tuple[str, ...]:
    """The latest step's best-rewarded completions: what the reward now pays for."""
    if not samples:
        return ()
    last = max(s.get("step", 0) for s in samples)
    recent = [s for s in samples if s.get("step", 0) == last and isinstance(s.get("completion"), str)]
    recent.sort(key=lambda s: -(s.get("reward") if isinstance(s.get("reward"), (int, float)) else float("-inf")))
    return tuple(dict.fromkeys(text_signals.short(s["completion"]) for s in recent))[:n]


def reward_outruns_heldout(history: list[dict], samples: list[dict]) -> Finding | None:
    """The training reward clearly rose while the held-out accuracy (or reward) stayed flat or fell."""
    steps, rewards = series(history, "reward")
    moved = change(rewards)
    if moved is None or not moved.rose:
        return None
    flat = _heldout_flat(history, moved)
    if flat is None:
        return None
    key, first, last, best_step = flat
    name = "accuracy" if key == "eval/accuracy" else "mean reward"
    return Finding("heldout_gap", "gaming", best_step,
                   f"the training reward rose {moved.first:.3f} -> {moved.last:.3f} while held-out {name} went "
                   f"{first:.3f} -> {last:.3f}: the policy is gaming the reward, not learning the task",
                   "Read the sample completions, tighten the reward (pay only for what the task needs), and "
                   "stop at or keep the checkpoint of the best held-out result.",
                   {"reward_first": moved.first, "reward_last": moved.last, f"heldout_{name}_first": first,
                    f"heldout_{name}_last": last}, _examples(samples))


def reward_saturated(history: list[dict], samples: list[dict]) -> Finding | None:
    """The reward sits at its maximum (most groups score alike, at the run's best) with no held-out gain."""
    steps, rewards = series(history, "reward")
    _, same = series(history, "frac_reward_zero_std")
    moved = change(rewards)
    if moved is None or not moved.rose or len(same) < WINDOW:
        return None
    top, bottom = max(smooth(rewards)), min(smooth(rewards))
    if statistics.fmean(same[-WINDOW:]) < SATURATED_GROUPS or moved.last < top - PLATEAU * (top - bottom):
        return None
    flat = _heldout_flat(history, moved)
    if flat is None:
        return None
    key, first, last, _ = flat
    began = next(s for s, v in zip(steps, smooth(rewards)) if v >= moved.last - moved.error)
    return Finding("reward_saturated", "gaming", began,
                   f"the reward is saturated at {moved.last:.3f} ({100 * statistics.fmean(same[-WINDOW:]):.0f}% of "
                   f"groups all score alike) with no held-out gain ({key} {first:.3f} -> {last:.3f}): the policy "
                   "found what the reward pays for, and it is not the task",
                   "Make the reward harder to satisfy without solving the task (check the answer, not its form); "
                   "more steps will not help.", {"reward": moved.last, "heldout_first": first, "heldout_last": last},
                   _examples(samples))


def traded_off(history: list[dict], samples: list[dict]) -> Finding | None:
    """One reward function rose while another fell: the composed reward is being traded off."""
    names = sorted({k[len("rewards/"):-len("/mean")] for h in history for k in h
                    if k.startswith("rewards/") and k.endswith("/mean")})
    moves = {}
    for name in names:
        steps, values = series(history, f"rewards/{name}/mean")
        if (moved := change(values)) is not None:
            moves[name] = (steps, values, moved)
    for up, (_, _, rise) in moves.items():
        for down, (steps, values, fall) in moves.items():
            if up != down and rise.rose and fall.fell:
                return Finding("traded_off", "gaming", onset(steps, values, rising=False),
                               f"reward {up} rose {rise.first:.3f} -> {rise.last:.3f} while reward {down} fell "
                               f"{fall.first:.3f} -> {fall.last:.3f}: the policy maxes one part of the composed "
                               "reward at the other's expense",
                               f"Raise {down}'s weight or lower {up}'s (reward_weights), cap {up}, or make {up} pay "
                               f"only when {down} is met.", {f"{up}_first": rise.first, f"{up}_last": rise.last,
                                                              f"{down}_first": fall.first, f"{down}_last": fall.last},
                               _examples(samples))
    return None


def length_runaway(history: list[dict], samples: list[dict]) -> Finding | None:
    """Completions grow to max_completion_length as the reward follows the length; or shrink as the reward falls."""
    steps, lengths = series(history, "completions/mean_length")
    _, rewards = series(history, "reward")
    grown = change(lengths)
    if grown is None or len(rewards) != len(lengths):
        return None
    _, clipped = series(history, "completions/clipped_ratio")
    clip_rise = (statistics.fmean(clipped[-WINDOW:]) - statistics.fmean(clipped[:WINDOW])
                 if len(clipped) >= 2 * WINDOW else 0.0)
    follows = spearman(lengths, rewards)
    # growth from where it began (the smoothed length at its lowest): a rise faster than one window, as a high
    # learning rate gives, would otherwise be half hidden in the first window's mean
    start = min(smooth(lengths))
    if (grown.rose and grown.last >= LENGTH_GROWTH * start and clip_rise >= CLIPPED_RISE
            and follows >= LENGTH_FOLLOWS_REWARD):
        return Finding("length_runaway", "gaming", onset(steps, lengths, rising=True),
                       f"completions grew from {start:.1f} to {grown.last:.1f} tokens, {100 * clip_rise:.0f} "
                       f"points more of them cut at max_completion_length, and the reward follows the length "
                       f"(rank correlation {follows:.2f}): the reward pays for length",
                       "Cap or penalise length (soft_overlong_penalty, a brevity term), or pay per answer rather "
                       "than per word.", {"length_first": start, "length_last": grown.last,
                                          "clipped_rise": clip_rise, "length_reward_correlation": follows},
                       _examples(samples))
    fell = change(rewards)
    if grown.fell and grown.last <= LENGTH_COLLAPSE * grown.first and fell is not None and fell.fell:
        return Finding("length_collapse", "collapse", onset(steps, lengths, rising=False),
                       f"completions shrank from {grown.first:.1f} to {grown.last:.1f} tokens while the reward fell "
                       f"{fell.first:.3f} -> {fell.last:.3f}: the policy is collapsing to short, empty answers",
                       "Lower the learning rate, raise beta, or check a length penalty that outweighs the task.",
                       {"length_first": grown.first, "length_last": grown.last}, _examples(samples))
    return None


def entropy_collapse(history: list[dict], samples: list[dict]) -> Finding | None:
    """Entropy far below its start and reward_std falling, without the reward having clearly risen."""
    steps, entropy = series(history, "entropy")
    _, spread = series(history, "reward_std")
    _, rewards = series(history, "reward")
    e, s, r = change(entropy), change(spread), change(rewards)
    if e is None or s is None or r is None or r.rose or e.first <= 0:
        return None  # a policy sharpening as its reward rises is learning
    if e.last < ENTROPY_COLLAPSE * e.first and s.last < SPREAD_COLLAPSE * max(s.first, 1e-9):
        return Finding("entropy_collapse", "collapse", onset(steps, entropy, rising=False),
                       f"entropy fell {e.first:.3f} -> {e.last:.3f} and reward_std {s.first:.3f} -> {s.last:.3f} "
                       f"while the reward did not rise ({r.first:.3f} -> {r.last:.3f}): the policy collapsed to "
                       "a few answers before learning the task",
                       "Lower the learning rate, raise the temperature, add an entropy bonus (entropy_coef), or "
                       "clip higher (epsilon_high).", {"entropy_first": e.first, "entropy_last": e.last,
                                                       "reward_std_first": s.first, "reward_std_last": s.last},
                       _examples(samples))
    return None


def kl_accelerating(history: list[dict], samples: list[dict]) -> Finding | None:
    """The KL to the reference growing faster and faster: each window's rise well above the one before."""
    steps, kl = series(history, "kl")
    if len(kl) < 3 * WINDOW or kl[-1] < KL_FLOOR:
        return None
    a, b, c = (statistics.fmean(kl[len(kl) - i * WINDOW:len(kl) - (i - 1) * WINDOW]) for i in (3, 2, 1))
    if b > a and c - b > KL_ACCELERATION * (b - a) and all(y >= x for x, y in zip(kl[-WINDOW - 1:], kl[-WINDOW:])):
        return Finding("kl_accelerating", "drift", steps[-2 * WINDOW],
                       f"the KL to the reference is accelerating ({a:.3f} -> {b:.3f} -> {c:.3f} over the last "
                       f"{3 * WINDOW} logged steps): the policy is running away from where it started",
                       "Lower the learning rate or raise beta; look at the completions for a shortcut.",
                       {"kl_windows": [a, b, c]}, _examples(samples))
    return None


def no_heldout(history: list[dict], samples: list[dict]) -> Finding | None:
    """Said once: without evaluation during training, gaming cannot be told from learning."""
    if len(history) >= MIN_STEPS and heldout(history) is None and series(history, "reward")[1]:
        return Finding(NO_HELDOUT_KEY, "note", None,
                       "note: this run makes no held-out evaluation during training, so a rising reward cannot be "
                       "told from a gamed one", "Set eval_strategy: steps and eval_steps: N (with an eval_dataset) "
                       "to have covey compare them.")
    return None


DETECTORS = [reward_outruns_heldout, reward_saturated, traded_off, length_runaway, entropy_collapse, kl_accelerating,
             text_signals.repetition, text_signals.same_across_prompts, text_signals.repeated_format, no_heldout]


def thin(history: list[dict], keep: int = MAX_ROWS) -> list[dict]:
    """A long history cut to about ``keep`` rows: the first and last quarter as they are, every k-th step
    between, and every row with a held-out result; the windows at each end, which the rules compare, intact."""
    if len(history) <= keep:
        return history
    edge = keep // 4
    middle = history[edge:-edge]
    stride = max(1, len(middle) // (keep - 2 * edge))
    kept = [h for i, h in enumerate(middle) if i % stride == 0 or "eval/accuracy" in h or "eval/mean_reward" in h]
    return history[:edge] + kept + history[-edge:]


def findings(history: list[dict], samples: list[dict] = ()) -> list[Finding]:
    """Every detector's finding over the history so far (a long one thinned to about MAX_ROWS rows)."""
    samples, history = list(samples), thin(history)
    return [f for detector in DETECTORS if (f := detector(history, samples)) is not None]


class Monitor:
    """The findings of a growing history, each kind once per run."""

    def __init__(self) -> None:
        self.shown: set[str] = set()

    def check(self, history: list[dict], samples: list[dict] = ()) -> list[Finding]:
        new = [f for f in findings(history, samples) if f.key not in self.shown]
        self.shown.update(f.key for f in new)
        return new
