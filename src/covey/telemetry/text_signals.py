"""Degenerate text in a run's sampled completions: repetition, one text for every prompt, format tags
repeated for credit. Pure functions over the recorded samples (dicts with ``step``, ``prompt``,
``completion`` and ``reward``, as completions.jsonl and TRL's completion logs hold them); the first
recorded steps are the baseline the latest are compared with.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter

from covey.telemetry.finding import Finding

SAMPLE_STEPS = 3  # recorded steps pooled at each end (the start and the latest)
MIN_TOKENS = 6  # completions shorter than this many tokens are too short to judge repetition on
REPETITION_HIGH = 0.3  # share of repeated word 3-grams in the latest completions ...
REPETITION_RISE = 0.2  # ... at least this much above the start's
SAME_SHARE = 0.5  # one completion given to this share of the distinct prompts ...
MIN_PROMPTS = 3  # ... and to at least this many of them
REPEATED_TAGS = 0.3  # share of the latest completions that repeat a format tag ...
REPEATED_TAGS_START = 0.1  # ... where at most this share did at the start
SHOWN_CHARS = 160  # characters of a completion quoted as evidence

TOKEN = re.compile(r"\w+|[^\w\s]+")
TAG = re.compile(r"<\s*([A-Za-z_][\w-]*)\s*>")


def short(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def repeated_ngrams(text: str, n: int = 3) -> float | None:
    """Share of a text's word n-grams that repeat an earlier one (None: too short to tell)."""
    tokens = TOKEN.findall(text.lower())
    if len(tokens) < MIN_TOKENS:
        return None
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams)


def repeats_a_tag(text: str) -> bool:
    """Some opening format tag (<answer>, <think>, ...) occurs more than once."""
    return any(count > 1 for count in Counter(TAG.findall(text)).values())


def _by_step(samples: list[dict]) -> list[list[dict]]:
    steps: dict[int, list[dict]] = {}
    for s in samples:
        if isinstance(s.get("completion"), str):
            steps.setdefault(int(s.get("step", 0)), []).append(s)
    return [steps[k] for k in sorted(steps)]


def _ends(samples: list[dict]) -> tuple[list[dict], list[dict], int] | None:
    """The samples of the first and of the latest SAMPLE_STEPS recorded steps (which do not overlap), and
    the first latest step; None with too few recorded steps."""
    steps = _by_step(samples)
    if len(steps) < 2 * SAMPLE_STEPS:
        return None
    latest = steps[-SAMPLE_STEPS:]
    return [s for g in steps[:SAMPLE_STEPS] for s in g], [s for g in latest for s in g], latest[0][0].get("step", 0)


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _best_rewarded(samples: list[dict], keep, n: int = 2) -> tuple[str, ...]:
    chosen = sorted((s for s in samples if keep(s)), key=lambda s: -(s.get("reward") or 0.0))
    return tuple(dict.fromkeys(short(s["completion"]) for s in chosen))[:n]


def repetition(history: list[dict], samples: list[dict]):
    """Completions repeat their own phrases far more than at the start."""
    ends = _ends(samples)
    if ends is None:
        return None
    start, latest, began = ends
    before = _mean([repeated_ngrams(s["completion"]) for s in start]) or 0.0
    now = _mean([repeated_ngrams(s["completion"]) for s in latest])
    if now is None or now < REPETITION_HIGH or now - before < REPETITION_RISE:
        return None
    return Finding("repetition", "gaming", began,
                   f"completions repeat themselves: {100 * now:.0f}% of their word 3-grams are repeats, against "
                   f"{100 * before:.0f}% at the start (the reward pays for repeated words or phrases)",
                   "Reward each thing once (count distinct matches), add a repetition penalty to the reward, or "
                   "lower the learning rate.", {"repeated_3grams_first": before, "repeated_3grams_last": now},
                   _best_rewarded(latest, lambda s: (repeated_ngrams(s["completion"]) or 0) >= REPETITION_HIGH))


def _prompt_key(prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def _question(sample: dict) -> str:
    """What a prompt asks, for telling prompts apart: its reference answer where the sample records one (two
    sums that both make 12 are one question to a completion that answers '12'), else the prompt itself."""
    answer = sample.get("answer")
    if isinstance(answer, (str, int, float)) and not isinstance(answer, bool) and str(answer).strip():
        return "answer: " + str(answer).strip()
    return _prompt_key(sample.get("prompt"))


def same_across_prompts(history: list[dict], samples: list[dict]):
    """One completion given to half or more of the distinct prompts (those with different reference answers,
    where they are recorded), at least MIN_PROMPTS, as half or more of those prompts' completions: the policy
    ignores its input."""
    ends = _ends(samples)
    if ends is None:
        return None
    _, latest, began = ends
    answers: dict[str, set[str]] = {}
    for s in latest:
        answers.setdefault(" ".join(s["completion"].split()), set()).add(_question(s))
    prompts = {_question(s) for s in latest}
    if len(prompts) < MIN_PROMPTS or not answers:
        return None
    text, given = max(answers.items(), key=lambda kv: len(kv[1]))
    share = len(given) / len(prompts)
    if share < SAME_SHARE or len(given) < MIN_PROMPTS or not text:  # two alike: a short answer's coincidence
        return None
    theirs = [s for s in latest if _question(s) in given]  # the completions of the prompts it answers ...
    if sum(" ".join(s["completion"].split()) == text for s in theirs) < SAME_SHARE * len(theirs):
        return None  # ... mostly something else: a policy that still reads its prompt, with one stock reply
    return Finding("same_completion", "gaming", began,
                   f"the same completion answers {len(given)} of {len(prompts)} different prompts in the latest "
                   "recorded steps: the policy no longer reads its prompt",
                   "The reward pays for a fixed text: make it depend on the prompt (check the answer), or lower "
                   "the learning rate.", {"share_of_prompts": share}, (short(text),))


def repeated_format(history: list[dict], samples: list[dict]):
    """Format tags repeated within completions, newly, and paid for."""
    ends = _ends(samples)
    if ends is None:
        return None
    start, latest, began = ends
    before = statistics.fmean(repeats_a_tag(s["completion"]) for s in start)
    now = statistics.fmean(repeats_a_tag(s["completion"]) for s in latest)
    if now < REPEATED_TAGS or before > REPEATED_TAGS_START:
        return None
    paid = [s.get("reward") for s in latest if isinstance(s.get("reward"), (int, float))]
    repeated = [s.get("reward") for s in latest if repeats_a_tag(s["completion"])
                and isinstance(s.get("reward"), (int, float))]
    if paid and repeated and statistics.fmean(repeated) < statistics.fmean(paid):
        return None  # repeated tags earn less than the rest: not paid for
    return Finding("repeated_format", "gaming", began,
                   f"{100 * now:.0f}% of the latest completions repeat a format tag (against {100 * before:.0f}% at "
                   "the start), and those earn at least the average reward: the format is paid for per tag",
                   "Pay for the format once (one well-formed block, nothing after it), not per occurrence.",
                   {"repeated_tags_first": before, "repeated_tags_last": now},
                   _best_rewarded(latest, lambda s: repeats_a_tag(s["completion"])))
