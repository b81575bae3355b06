"""Reading answers from completions: the assistant text, the last <answer> block, and the number
it holds (as people and models write numbers: '1,234', '$12', '\\boxed{72}', '50%', '72 dollars'),
compared with a dataset's reference answer (a number, or a GSM8K solution ending '#### N')."""

from __future__ import annotations

import math
import re
from typing import Any

TAGGED_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
# A number as written: a sign (a hyphen after a letter or digit, as in "10-2", is not one), a dollar sign,
# digits with commas only before groups of exactly three ("1,234"; "3,4,5" is three numbers), and a
# decimal part, also on its own (".5").
NUMBER = re.compile(r"(?:(?<!\w)[-+\u2212])?\$?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\d.])\.\d+)")
# a fraction of whole numbers: "3/4", "-3/4", "\\frac{3}{4}", "\\dfrac{3}{4}"
FRACTION = re.compile(r"([-+\u2212]?)(?:(\d+)\s*/\s*(\d+)|\\d?frac\{\s*(\d+)\s*\}\{\s*(\d+)\s*\})")
# what may wrap a number: \boxed{72}, $72$, **72**, \(72\), x = 72
WRAPPED = tuple(re.compile(pattern, re.DOTALL) for pattern in (
    r"\\boxed\{(.*)\}", r"\$(.*)\$", r"\*\*(.*)\*\*", r"\\\((.*)\\\)", r"[^\W\d]\w*\s*=\s*(.*)"))
# a number followed by a percent sign or one unit word: "50%", "72 dollars"
WITH_UNIT = re.compile(r"(.*?)\s*(?:\\?%|([^\W\d_]+))", re.DOTALL)
# words after a number that change its value, so are not units ("3 million" is not 3, "2 pi" is not 2)
NOT_UNITS = frozenset({"k", "hundred", "hundreds", "thousand", "thousands", "million", "millions", "billion", "billions",
                       "trillion", "trillions", "dozen", "dozens", "half", "halves", "third", "thirds", "quarter",
                       "quarters", "tenth", "tenths", "fourth", "fourths", "fifth", "fifths", "ten", "tens",
                       "m", "b", "mn", "bn", "x", "times", "e", "squared", "cubed", "pi", "\u03c0"})
GSM8K_MARKER = "####"


def completion_text(completion: Any) -> str:
    """The assistant text of a completion in either format."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content", "") for message in completion if message.get("role") == "assistant")


def unwrapped(text: str) -> str:
    """``text`` without the markup around a number: \\boxed{}, $...$, **...**, \\(...\\), 'x = ', a
    trailing full stop."""
    text = text.strip().rstrip(".").strip()
    while match := next((m for m in (w.fullmatch(text) for w in WRAPPED) if m), None):
        text = match.group(1).strip().rstrip(".").strip()
    return text


def parse_number(text: Any) -> float | None:
    """A finite number written as text or given as a number; None if it is not one (NaN, or too large
    for a float, is not). The text may be '1,234', '-3.5', '.5', '+2', '\u22125', '$12', ' 42 ', and may be
    wrapped ('\\boxed{72}', '$72$', '**72**', 'x = 72') or followed by '%' or a unit word ('72 dollars'), or be
    a fraction of whole numbers ('3/4', '\\frac{3}{4}': 0.75)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        try:
            value = float(text)
        except OverflowError:
            return None
    else:
        written = unwrapped(str(text))
        unit = WITH_UNIT.fullmatch(written) if len(written) <= 64 else None  # an answer, not a paragraph
        if unit is not None and (unit.group(2) or "").lower() not in NOT_UNITS:
            written = unwrapped(unit.group(1))
        match = NUMBER.fullmatch(written)
        if match is None:
            return _fraction(written)
        value = float(match.group().replace(",", "").replace("$", "").replace("\u2212", "-"))
    return value if math.isfinite(value) else None


def _fraction(written: str) -> float | None:
    match = FRACTION.fullmatch(written)
    if match is None:
        return None
    sign, numerator, denominator = match.group(1), match.group(2) or match.group(4), match.group(3) or match.group(5)
    if int(denominator) == 0:
        return None
    value = int(numerator) / int(denominator)
    return -value if sign in ("-", "\u2212") else value


def reference_number(answer: Any) -> float | None:
    """The number a dataset's answer holds: the answer itself, or what follows the last '####' of a
    raw GSM8K solution ('... so she has 72 #### 72')."""
    if isinstance(answer, str) and GSM8K_MARKER in answer:
        answer = answer.rsplit(GSM8K_MARKER, 1)[1]
    return parse_number(answer)


def reference_math(answer: Any) -> str | None:
    """A dataset's answer to read as mathematics (what follows the last '####' of a GSM8K-style
    solution): text with a digit or a LaTeX command in it ('[0, 1)', '\\frac{\\sqrt{3}}{2}', '\\pi');
    None for anything else, words above all ('n/a', 'Paris'), which math-verify would read as products
    of variables."""
    if not isinstance(answer, str):
        return None
    text = (answer.rsplit(GSM8K_MARKER, 1)[1] if GSM8K_MARKER in answer else answer).strip()
    return text if re.search(r"[\d\\]", text) else None


def same_number(given: float | None, expected: float | None) -> bool:
    """Both are numbers and equal up to float noise: within 1e-6, or to 12 significant digits (the
    default relative tolerance, 1e-9, would call 1000000000 and 1000000001 equal)."""
    return given is not None and expected is not None and math.isclose(given, expected, rel_tol=1e-12, abs_tol=1e-6)


def tagged_answer(text: str) -> str | None:
    """The content of the last <answer>...</answer> block (the final answer of a model that wrote
    several), or None."""
    blocks = TAGGED_ANSWER.findall(text)
    return blocks[-1] if blocks else None


def last_number(text: str) -> float | None:
    numbers = NUMBER.findall(text)
    return parse_number(numbers[-1]) if numbers else None


def is_correct(completion: Any, answer: Any) -> bool:
    """Strict check used for evaluation: the answer is in <answer> tags and equals ``answer``."""
    return same_number(parse_number(tagged_answer(completion_text(completion)) or ""), reference_number(answer))
