"""The built-in reward functions: answer format and correctness, reasoning and JSON format, DAPO's soft
overlong penalty, and the sandboxed code tests (each by name in ``reward_funcs``)."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Callable

from covey.data.text import THINK_CLOSE, THINK_OPEN, answer_after_reasoning
from covey.errors import RewardError
from covey.rewards import symbolic
from covey.rewards.answers import (NUMBER, completion_text, last_number, parse_number, reference_math, reference_number,
                                   same_number, tagged_answer)
from covey.rewards.convention import RewardFunc


def answer_format(completions: list, **_: Any) -> list[float]:
    """Partial credit for '<answer>N</answer>': a quarter each for the opening tag, the closing tag,
    a bare number inside the last block (a sign, a leading $ and thousands commas, but no other
    markup or unit: the format asked for), and nothing written after the closing tag."""
    scores = []
    for completion in completions:
        text = completion_text(completion)
        score = 0.25 * ("<answer>" in text) + 0.25 * ("</answer>" in text)
        inside = tagged_answer(text)
        if inside is not None:
            score += 0.25 * (NUMBER.fullmatch(inside.strip().rstrip(".")) is not None)
            score += 0.25 * (text.rstrip().endswith("</answer>"))
        scores.append(score)
    return scores


def answer_correct(completions: list, answer: list, **_: Any) -> list[float | None]:
    """1 if the (last) tagged answer equals the `answer` column; 0.5 if there is no tagged answer but
    the final answer of the text is right; 0 otherwise. A number (or a GSM8K solution ending '#### N')
    is compared by covey itself, with the last number in the text as the final answer; other
    mathematics (\\frac{\\sqrt{3}}{2}, an interval, a set) by math-verify where it is installed, else
    None, as for a row without a usable answer (words, say)."""
    scores: list[float | None] = []
    symbolic_rows, comparisons = [], []  # (row, worth) and (reference, answer, style) of what math-verify compares
    for i, (completion, expected) in enumerate(zip(completions, answer)):
        text = completion_text(completion)
        inside = tagged_answer(text)
        target = reference_number(expected)
        if target is not None:
            if inside is not None:
                scores.append(1.0 if same_number(parse_number(inside), target) else 0.0)
            else:
                scores.append(0.5 if same_number(last_number(text), target) else 0.0)
            continue
        scores.append(None)
        if symbolic.available() and (reference := reference_math(expected)) is not None:
            symbolic_rows.append((i, 0.5 if inside is None else 1.0))
            comparisons.append((reference, text, symbolic.IN_TEXT) if inside is None else
                               (reference, inside, symbolic.TAGGED))
    for (i, worth), verdict in zip(symbolic_rows, symbolic.verdicts(comparisons)):
        scores[i] = None if verdict.correct is None else worth * verdict.correct
    return scores


def reasoning_format(completions: list, **_: Any) -> list[float]:
    """Partial credit for '<think>reasoning</think> answer': a quarter each for the opening tag, the
    closing tag, reasoning inside the block, and an answer after it. (Where the chat template opens the
    block in the prompt, every completion misses the first quarter alike: the advantages are the same.)"""
    scores = []
    for completion in completions:
        text = completion_text(completion)
        opened, closed = THINK_OPEN in text, THINK_CLOSE in text
        inside = text.split(THINK_OPEN, 1)[1] if opened else text
        inside = inside.split(THINK_CLOSE, 1)[0] if closed else ""
        after = answer_after_reasoning(text) if closed else ""
        scores.append(0.25 * opened + 0.25 * closed + 0.25 * bool(inside.strip()) + 0.25 * bool(after))
    return scores


def json_format(completions: list, **_: Any) -> list[float]:
    """1 if the answer (what follows any reasoning block) is a JSON object or array and nothing else;
    0.5 if one can be read from it (in a code fence, or starting at one of its first 16 '{' or '['); 0
    otherwise."""
    scores = []
    for completion in completions:
        answer = answer_after_reasoning(completion_text(completion)).strip()
        if isinstance(_json_value(answer), (dict, list)):
            scores.append(1.0)
            continue
        fenced = (_json_value(m.group(1)) for m in _CODE_FENCE.finditer(answer))
        opened = (_json_value(answer[m.start():], prefix=True)
                  for m in itertools.islice(_JSON_OPENING.finditer(answer), 16))
        scores.append(0.5 if any(isinstance(v, (dict, list)) for v in (*fenced, *opened)) else 0.0)
    return scores


_CODE_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
_JSON_OPENING = re.compile(r"[{\[]")


def _json_value(text: str, prefix: bool = False) -> Any:
    """``text`` read as JSON (with ``prefix``, the value it starts with, what follows ignored), or None:
    not JSON, or nested too deep to read."""
    try:
        return json.JSONDecoder().raw_decode(text)[0] if prefix else json.loads(text)
    except (ValueError, RecursionError):
        return None


def tool_use(completions: list, **_: Any) -> list[float]:
    """For episodes with tools: 0.5 for a turn with a tool call the format could read, 1 when besides
    every call made got a result rather than an error (covey's tool errors start with "error:"); 0 for
    an episode without a call, and for plain completions."""
    scores = []
    for completion in completions:
        messages = completion if isinstance(completion, list) else []
        called = any(m.get("tool_calls") for m in messages if m.get("role") == "assistant")
        results = [str(m.get("content", "")) for m in messages if m.get("role") == "tool"]
        answered = bool(results) and not any(r.startswith("error:") for r in results)
        scores.append(0.5 * called + 0.5 * (called and answered))
    return scores


class SoftOverlongPenalty:
    """DAPO's soft overlong punishment (eq. 13): 0 up to max_length - cache_length tokens, then a
    linear ramp down to -1 at max_length, and -1 beyond (with cache_length 0, straight from 0 to -1).
    Penalises length without rewarding brevity."""

    def __init__(self, max_length: int, cache_length: int, name: str = "soft_overlong_penalty"):
        if not 0 <= cache_length <= max_length:
            raise RewardError(f"{name}: need 0 <= cache_length ({cache_length}) <= max_length ({max_length})")
        self.max_length, self.cache_length = max_length, cache_length
        self.__name__ = name

    def __call__(self, completion_ids: list[list[int]], **_: Any) -> list[float]:
        free = self.max_length - self.cache_length
        return [0.0 if len(ids) <= free else -1.0 if len(ids) > self.max_length else (free - len(ids)) / self.cache_length
                for ids in completion_ids]


BUILTIN_REWARDS: dict[str, RewardFunc] = {"answer_format": answer_format, "answer_correct": answer_correct,
                                           "reasoning_format": reasoning_format, "json_format": json_format,
                                           "tool_use": tool_use}


def code_tests(**settings: Any) -> RewardFunc:
    """The sandboxed code-execution reward (``covey.rewards.code``; Linux only, so imported on use)."""
    from covey.rewards.code import CodeTests

    return CodeTests(**settings)


# Built-ins that take settings (from the config fields named in their help).
BUILTIN_REWARD_FACTORIES: dict[str, Callable[..., RewardFunc]] = {"soft_overlong_penalty": SoftOverlongPenalty,
                                                                "code_tests": code_tests}
