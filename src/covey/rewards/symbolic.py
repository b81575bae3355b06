"""Answers compared as mathematics by math-verify (the optional extra ``covey[math]``): fractions,
roots, intervals, sets, expressions, written in LaTeX or plain text.

math-verify bounds its own work with SIGALRM, which only the main thread may set, so a reward called
in a thread (under reward_timeout) would fail. Its own limits are turned off here, and each comparison
runs in a worker process (``RewardPool``) under ``TIME_LIMIT`` seconds instead: sympy can spend minutes
in one C call (a huge power, say) that holds the interpreter lock, which no thread could interrupt,
whereas a worker that runs over is killed. A comparison that runs over counts as not correct.

    verdicts([(r"\\frac{1}{2}", "0.5", TAGGED)])  ->  [Verdict(correct=True, ...)]
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass
from typing import Sequence

from covey.errors import RewardError
from covey.rewards.pool import RewardPool
from covey.rewards.scoring import call_reward

TIME_LIMIT = 10.0  # seconds for one comparison: reading both sides and checking them equal
INSTALL_HINT = "pip install 'covey[math]' (or pip install math-verify)"

# How the answer side is read (the reference is read as by TAGGED, except under TRL, which reads it as TRL does):
TAGGED = "tagged"  # a bare answer, as in <answer> tags: "\\frac{1}{2}", "[0, 1)"
IN_TEXT = "in_text"  # the final answer math-verify finds in a whole completion (\\boxed{}, $...$, "the answer is")
TRL = "trl"  # trl.rewards.accuracy_reward's reading: the first LaTeX answer, \\boxed{} first, units normalised


@dataclass(frozen=True)
class Verdict:
    correct: bool | None  # None: the reference is not mathematics math-verify can read
    reference: str  # what math-verify read on each side, for log_extra
    answer: str


def available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def require(reward: str) -> None:
    if not available():
        raise RewardError(f"reward function {reward!r} compares answers with math-verify, which is not installed: "
                          f"{INSTALL_HINT}")


def verdicts(comparisons: Sequence[tuple[str, str, str]]) -> list[Verdict]:
    """Whether the two sides of each (reference, answer, style) are equal as mathematics (``style``: how
    the answer is read); one comparison at a time per worker, each under TIME_LIMIT seconds."""
    calls = [(_compare, {"reference": reference, "answer": answer, "style": style})
             for reference, answer, style in comparisons]
    if not calls:
        return []
    with _LOCK:  # an earlier call abandoned by reward_timeout may still be using the workers
        outcomes = _workers().run(calls, TIME_LIMIT)
    return [Verdict(*outcome) if isinstance(outcome, tuple) else Verdict(False, "[not read]", _failure(outcome))
            for outcome in outcomes]


def _failure(outcome: BaseException) -> str:
    return f"[over {TIME_LIMIT:g}s]" if isinstance(outcome, TimeoutError) else f"[failed: {outcome}]"


def as_math(text: str) -> str:
    """``text`` inside $...$ unless it has math delimiters or \\boxed{} of its own: math-verify reads LaTeX
    only between delimiters ("\\frac{1}{2}" alone reads as nothing)."""
    return text if any(mark in text for mark in ("$", "\\boxed", "\\(", "\\[")) else f"${text}$"


def _compare(reference: str, answer: str, style: str) -> tuple[bool | None, str, str]:
    """One comparison, in a worker: (correct, what was read of the reference, of the answer)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    gold = parse(reference if style == TRL else as_math(reference), parsing_timeout=None)
    if not gold:
        return None, "[unparseable]", "[skipped]"
    if style == TRL:
        latex = LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                                      try_extract_without_anchor=False)
        given = parse(answer, extraction_config=[latex], extraction_mode="first_match", parsing_timeout=None)
    else:
        given = parse(as_math(answer) if style == TAGGED else answer, parsing_timeout=None)
    return bool(verify(gold, given, timeout_seconds=None)), str(gold), str(given) if given else "[unparseable]"


_LOCK = threading.Lock()
_POOLS: dict[int, RewardPool] = {}  # per process: a reward worker that compares answers forks workers of its own


def _after_fork() -> None:
    """In a forked child, a lock of its own: the copy may be held by a thread of the parent's that is not here."""
    global _LOCK
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork)


def _workers() -> RewardPool | _InProcess:
    if (pool := _POOLS.get(os.getpid())) is None:
        # the "timeout is disabled" warnings say what this module does on purpose
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
        _compare(r"\frac{1}{2}", "0.5", TAGGED)  # the parsers build their tables once, before the workers fork
        if "fork" in multiprocessing.get_all_start_methods():
            pool = RewardPool([_compare], min(4, os.cpu_count() or 1))
        else:  # no worker processes here: a thread, abandoned when it runs over (see the module docstring)
            pool = _InProcess()
        _POOLS[os.getpid()] = pool
    return pool


class _InProcess:
    """``RewardPool.run`` for platforms without fork: each call in a daemon thread, abandoned past the limit."""

    def run(self, calls: list, timeout: float) -> list:
        outcomes = []
        for func, kwargs in calls:
            try:
                outcomes.append(call_reward(func, kwargs, timeout))
            except Exception as e:  # as the pool reports it: the outcome, not a raise
                outcomes.append(e)
        return outcomes
