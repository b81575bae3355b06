"""TRL's built-in reward functions (``trl.rewards``) under their names, with their meaning and
signatures, so that a TRL script moves across: ``reward_funcs=["accuracy_reward"]``, or
``from covey.rewards import accuracy_reward, get_soft_overlong_punishment``.

    accuracy_reward, reasoning_accuracy_reward   math-verify's verdict on the answer against `solution`
    think_format_reward                           1 for '<think>...</think>' first, 0 otherwise
    get_soft_overlong_punishment(...)             DAPO's length penalty (covey's soft_overlong_penalty)
    get_cosine_scaled_reward(...)                 correctness scaled by length on a cosine
    get_repetition_penalty_reward(...)            the share of repeated token n-grams, as a penalty

The ``get_*`` are factories: each returns the reward function. Unlike TRL's, these also read plain-text
completions, and the math-verify comparisons run under covey's own time limit (``symbolic``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from covey.data.text import THINK_CLOSE, THINK_OPEN
from covey.errors import RewardError
from covey.rewards import symbolic
from covey.rewards.answers import completion_text
from covey.rewards.builtin import SoftOverlongPenalty


def accuracy_reward(completions: list, solution: list[str], log_extra: Callable | None = None,
                    **kwargs: Any) -> list[float | None]:
    """1.0 if the completion's first LaTeX answer (\\boxed{} first) equals `solution` by math-verify,
    else 0.0; None where math-verify cannot read the solution. Logs what it read of both (log_extra)."""
    symbolic.require("accuracy_reward")
    return _judged([completion_text(c) for c in completions], solution, log_extra)


def reasoning_accuracy_reward(completions: list, solution: list[str], reasoning_delimiters: list[str] | None = None,
                              log_extra: Callable | None = None, **kwargs: Any) -> list[float | None]:
    """accuracy_reward on what follows the reasoning: the text after the last occurrence of the first of
    ``reasoning_delimiters`` (default: </think>) that the completion holds; 0.0 where it holds none
    (reasoning left unfinished)."""
    symbolic.require("reasoning_accuracy_reward")
    delimiters = [THINK_CLOSE] if reasoning_delimiters is None else reasoning_delimiters
    answers: list[str | None] = []
    for completion in completions:
        text = completion_text(completion)
        ending = next((d for d in delimiters if d in text), None)
        answers.append(None if ending is None else text.rsplit(ending, 1)[1])
    return _judged(answers, solution, log_extra)


def _judged(answers: list[str | None], solution: list[str], log_extra: Callable | None) -> list[float | None]:
    """math-verify's verdict on each answer (None: unfinished reasoning, scored 0.0), and the columns TRL
    logs beside: the solution and what was read of each side."""
    if len(answers) != len(solution):
        raise RewardError(f"got {len(answers)} completions and {len(solution)} solutions")
    judged = [i for i, a in enumerate(answers) if a is not None]
    found = symbolic.verdicts([(solution[i], answers[i], symbolic.TRL) for i in judged])
    verdicts: list[symbolic.Verdict] = [symbolic.Verdict(False, "[incomplete reasoning]", "[incomplete reasoning]")
                                        ] * len(answers)
    for i, verdict in zip(judged, found):
        verdicts[i] = verdict
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", [v.reference for v in verdicts])
        log_extra("answer_parsed", [v.answer for v in verdicts])
    return [None if v.correct is None else float(v.correct) for v in verdicts]


def think_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 if the completion opens with <think>, opens no second block, and closes it; else 0.0."""
    scores = []
    for completion in completions:
        text = completion_text(completion)
        rest = text[len(THINK_OPEN):]
        scores.append(float(text.startswith(THINK_OPEN) and THINK_OPEN not in rest and THINK_CLOSE in rest))
    return scores


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPenalty:
    """DAPO's soft overlong punishment (eq. 13): 0 up to max_completion_len - soft_punish_cache tokens,
    a linear ramp to -1 at max_completion_len, -1 beyond (soft_punish_cache 0: no ramp)."""
    return SoftOverlongPenalty(max_completion_len, soft_punish_cache, name="soft_overlong_punishment_reward")


def get_cosine_scaled_reward(max_len: int, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                             min_value_correct: float = 0.5, max_value_correct: float = 1.0) -> CosineScaledReward:
    """Correctness (accuracy_reward) scaled by length on a cosine ("Demystifying Long Chain-of-Thought
    Reasoning", appendix C.1): a correct answer earns max_value_correct at length 0 down to
    min_value_correct at max_len; a wrong one min_value_wrong at length 0 up to max_value_wrong at max_len
    (so short wrong answers cost most); lengths past max_len count as max_len."""
    return CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)


class CosineScaledReward:
    __name__ = "cosine_scaled_reward"

    def __init__(self, max_len: int, min_value_wrong: float, max_value_wrong: float, min_value_correct: float,
                 max_value_correct: float):
        if max_len < 1:
            raise RewardError(f"cosine_scaled_reward: max_len={max_len} must be at least 1")
        self.max_len = max_len
        self.correct_span = (min_value_correct, max_value_correct)  # (at max_len, at length 0)
        self.wrong_span = (max_value_wrong, min_value_wrong)

    def __call__(self, completions: list, solution: list[str], completion_ids: list[list[int]],
                 **kwargs: Any) -> list[float | None]:
        scores: list[float | None] = []
        for correct, ids in zip(accuracy_reward(completions, solution), completion_ids):
            if correct is None:
                scores.append(None)
                continue
            at_end, at_start = self.correct_span if correct else self.wrong_span
            cosine = math.cos(math.pi * min(len(ids) / self.max_len, 1.0))  # 1 at length 0, -1 at max_len
            scores.append(at_end + 0.5 * (at_start - at_end) * (1.0 + cosine))
        return scores


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RepetitionPenalty:
    """max_penalty times the share of a completion's token n-grams that repeat an earlier one
    (1 - distinct / all; "Demystifying Long Chain-of-Thought Reasoning", appendix C.2); 0.0 for a
    completion shorter than ngram_size tokens."""
    return RepetitionPenalty(ngram_size, max_penalty)


class RepetitionPenalty:
    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float):
        if max_penalty > 0:
            raise RewardError(f"repetition_penalty_reward: max_penalty={max_penalty} must not be positive (a penalty)")
        if ngram_size < 1:
            raise RewardError(f"repetition_penalty_reward: ngram_size={ngram_size} must be at least 1")
        self.ngram_size, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        scores = []
        for ids in completion_ids:
            ngrams = [tuple(ids[i:i + self.ngram_size]) for i in range(len(ids) - self.ngram_size + 1)]
            repeated = 1.0 - len(set(ngrams)) / len(ngrams) if ngrams else 0.0
            scores.append(repeated * self.max_penalty if repeated else 0.0)
        return scores


# checked when a run loads them, before any model: math-verify is an optional extra
accuracy_reward.needs_math_verify = reasoning_accuracy_reward.needs_math_verify = True
CosineScaledReward.needs_math_verify = True

TRL_REWARDS = {"accuracy_reward": accuracy_reward, "reasoning_accuracy_reward": reasoning_accuracy_reward,
               "think_format_reward": think_format_reward}
TRL_REWARD_FACTORIES = {"get_soft_overlong_punishment": get_soft_overlong_punishment,
                        "get_cosine_scaled_reward": get_cosine_scaled_reward,
                        "get_repetition_penalty_reward": get_repetition_penalty_reward}
