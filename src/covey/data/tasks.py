"""Built-in tasks: seeded problem sets with disjoint train and held-out splits.

Each task yields rows in the dataset format covey trains on: a chat ``prompt`` plus an ``answer``
column that the built-in rewards (``answer_format``, ``answer_correct``) read.
"""

from __future__ import annotations

import json
import random

from covey.errors import DataError

ANSWER_SYSTEM_PROMPT = (
    "Add the two numbers. Write the sum, then the final answer in answer tags. Example:\n"
    "5 + 7 = 12\n<answer>12</answer>"
)
GSM8K_SYSTEM_PROMPT = (
    "Solve the problem step by step, then give only the final number in answer tags. Example:\n"
    "3 apples + 4 apples = 7 apples\n<answer>7</answer>"
)
ARITHMETIC_TEMPLATES = ("What is {a} + {b}?", "Compute {a} + {b}.", "{a} + {b} = ?")
ARITHMETIC_MAX_OPERAND = 12
ARITHMETIC_HELDOUT_PAIRS = 64
SPLIT_SEED = 1234  # fixed, so every run is evaluated on the same held-out problems


def chat_prompt(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def arithmetic(split: str) -> list[dict]:
    """Sums a + b with 0 <= a, b <= 12. The (a, b) pairs of the held-out split never occur in
    training, in any phrasing; training sees each remaining pair in every phrasing."""
    pairs = [(a, b) for a in range(ARITHMETIC_MAX_OPERAND + 1) for b in range(ARITHMETIC_MAX_OPERAND + 1)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    if split == "test":
        chosen = [(a, b, ARITHMETIC_TEMPLATES[i % len(ARITHMETIC_TEMPLATES)])
                  for i, (a, b) in enumerate(pairs[:ARITHMETIC_HELDOUT_PAIRS])]
    else:
        chosen = [(a, b, t) for a, b in pairs[ARITHMETIC_HELDOUT_PAIRS:] for t in ARITHMETIC_TEMPLATES]
    return [{"prompt": chat_prompt(ANSWER_SYSTEM_PROMPT, t.format(a=a, b=b)), "answer": str(a + b)}
            for a, b, t in chosen]


MULTIPLICATION_SYSTEM_PROMPT = "Multiply the two numbers with the calculate tool, then give its result in answer tags."


def _worked_exchange(a: int, b: int) -> list[dict]:
    """One question answered with the tool: the call, its result, and the answer."""
    call = {"name": "calculate", "arguments": {"expression": f"{a} * {b}"}}
    return [{"role": "user", "content": f"What is {a} * {b}?"},
            {"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"},
            {"role": "tool", "name": "calculate", "content": str(a * b)},
            {"role": "assistant", "content": f"<answer>{a * b}</answer>"}]


# a worked exchange before the question: the model sees the tool called, its result, and the answer
MULTIPLICATION_EXAMPLES = _worked_exchange(12, 345)
MULTIPLICATION_TEMPLATES = ("What is {a} * {b}? Use the tool.", "Compute {a} * {b}. Use the tool.", "{a} * {b} = ? Use the tool.")
MULTIPLICATION_HELDOUT = 64


def multiplication(split: str) -> list[dict]:
    """Products a * b of a 2-digit a and a 3-digit b, which a small model cannot work out in its head
    but can with the ``calculate`` tool (``examples/multiplication_tool.yaml``). The held-out split is
    64 products whose pairs never occur in training; training draws from the other 80,936."""
    rng = random.Random(SPLIT_SEED)
    pairs = [(a, b) for a in range(10, 100) for b in range(100, 1000)]
    rng.shuffle(pairs)
    chosen = pairs[:MULTIPLICATION_HELDOUT] if split == "test" else pairs[MULTIPLICATION_HELDOUT:]
    return [{"prompt": [{"role": "system", "content": MULTIPLICATION_SYSTEM_PROMPT}, *MULTIPLICATION_EXAMPLES,
                        {"role": "user", "content": MULTIPLICATION_TEMPLATES[i % 3].format(a=a, b=b)}],
             "answer": str(a * b)} for i, (a, b) in enumerate(chosen)]


def gsm8k_final_answer(solution: str) -> str:
    """GSM8K writes the final number after '####'."""
    if not isinstance(solution, str) or "####" not in solution:
        raise ValueError("no '####' final-answer marker")
    return solution.split("####")[-1].strip().replace(",", "")


def gsm8k_rows(records: list[dict], source: str = "gsm8k") -> list[dict]:
    """GSM8K-format records ({question, answer with '#### N'}) as chat prompts with an `answer` column
    (the final number) and a `solution` column (the full answer text, unless the record has a
    `solution` of its own, which is kept). Every other column is kept as it is, for the reward
    functions; a record with a `prompt` column of its own is an error, as covey makes that one."""
    rows = []
    for i, record in enumerate(records):
        if "prompt" in record:
            raise DataError(f"{source}, row {i}: GSM8K-format data (question, answer) has a column 'prompt', which "
                            "covey makes from the question; rename that column")
        try:
            answer = gsm8k_final_answer(record["answer"])
        except (KeyError, ValueError) as e:
            raise DataError(f"{source}, row {i}: not GSM8K format ({e}); expected 'question' and an 'answer' "
                            "ending in '#### <number>'") from None
        others = {key: value for key, value in record.items() if key not in ("question", "answer")}
        rows.append({"prompt": chat_prompt(GSM8K_SYSTEM_PROMPT, record["question"]), "answer": answer,
                     "solution": record["answer"], **others})
    return rows


TASKS = {"arithmetic": arithmetic, "multiplication": multiplication}
