"""The ``code_tests`` reward: run the completion's Python against the dataset's tests in a sandbox.

A dataset row carries ``tests``: Python test code, or a list of statements (usually asserts). The
completion's program is its last fenced Python block (without one, its last untagged block; without
either, its whole text). The score is 1.0 when the program and then the tests run to their end in one
sandboxed process, 0.0 otherwise; rows without tests score None.

Passing is judged by the harness writing a secret token, read from stdin before the program starts,
after the last test; the exit code or anything the program prints alone cannot fake it. So a program
that exits early (``sys.exit(0)``, ``os._exit(0)``) or prints "all tests passed" scores 0. There is
no partial credit per assert: the program shares the tests' process, so any count it could report
could be forged. The tests see the program's definitions but the builtins as they were before it ran;
a program that alters the interpreter more deeply can still cheat (docs/sandbox.md, "Scoring"): the
reward is a test of the program's behaviour, not a barrier against reward hacking.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import secrets
from typing import Any

from covey.errors import RewardError
from covey.answers import completion_text
from covey.sandbox import available_isolation, run_python

# what opens a fenced block: three or more backticks and an optional language tag ("```python") ending
# a line, at its start or after some words ("Here is the code: ```python")
OPENING_FENCE = re.compile(r"(?:^|(?<=\s))(`{3,})[ \t]*([^`\s]*)[ \t]*$")
PYTHON_TAGS = frozenset({"python", "python3", "py"})

# Runs the program, then the tests. ``__name__`` is not "__main__", so a program's own
# ``if __name__ == "__main__":`` demo does not run (it would wait for input that never comes). What the
# harness uses after the program is bound before it; the tests run in a namespace of their own holding
# the program's definitions, less those that shadow a builtin, with a copy of the builtins taken before
# the program ran. So replacing ``compile``, ``exec``, ``type`` or ``isinstance``, by a global of the
# program or in the ``builtins`` module, changes nothing for the tests.
HARNESS = """\
import builtins, os, sys


def _covey_harness(program, tests):
    token = sys.stdin.readline().strip()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    compile_, exec_, flush, write = compile, exec, sys.stdout.flush, os.write
    pristine = dict(vars(builtins))
    solution = {{"__name__": "solution"}}
    exec_(compile_(program, "solution.py", "exec"), solution)
    checked = {{name: value for name, value in solution.items() if name not in pristine}}
    checked.update(__builtins__=pristine, __name__="solution")
    exec_(compile_(tests, "tests.py", "exec"), checked)
    flush()
    write(1, ("\\n" + token + "\\n").encode())


_covey_harness({program!r}, {tests!r})
"""


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, lowercased, or "" for none; code) of each fenced block, read line by line so that
    each opening fence pairs with its own closing fence. A block closes at a line that starts with at
    least as many backticks (words after them are prose), or at a line of code ending in them
    ("x = 1```"); one left open runs to the end, unless nothing follows its fence."""
    blocks: list[tuple[str, str]] = []
    fence, tag, code = None, "", []
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if fence is None:
            opening = OPENING_FENCE.search(stripped)
            if opening is not None:
                fence, tag, code = opening.group(1), opening.group(2).lower(), []
        elif stripped.startswith(fence):
            blocks.append((tag, "".join(code)))
            fence = None
        elif stripped.endswith(fence):
            blocks.append((tag, "".join(code) + line.rstrip()[:-len(fence)]))
            fence = None
        else:
            code.append(line)
    if fence is not None and "".join(code).strip():
        blocks.append((tag, "".join(code)))
    return blocks


def program_of(completion: Any) -> str:
    """The code of the completion's last fenced block tagged python (py, python3); without one, of its
    last untagged block; without either, its whole text."""
    text = completion_text(completion)
    blocks = fenced_blocks(text)
    python = [code for tag, code in blocks if tag in PYTHON_TAGS] or [code for tag, code in blocks if not tag]
    return python[-1] if python else text


def code_of_tests(tests: Any) -> str | None:
    """The row's tests as code: a string as it is, a list of statements one per line; None if empty."""
    if isinstance(tests, (list, tuple)):
        tests = "\n".join(str(t) for t in tests)
    if tests is None or not str(tests).strip():
        return None
    if not isinstance(tests, str):
        raise RewardError(f"code_tests: a row's tests must be Python code or a list of statements, "
                          f"got {type(tests).__name__}")
    return tests


class CodeTests:
    """Reward 1.0 for a completion whose program passes its row's tests, run in a sandbox
    (``covey.sandbox``) with ``timeout`` wall seconds and ``memory_limit_mb`` of memory; the batch's
    programs run concurrently, each in its own process, ``workers`` at a time."""

    __name__ = "code_tests"

    def __init__(self, timeout: float = 5.0, memory_limit_mb: int = 512, workers: int | None = None):
        if timeout <= 0 or memory_limit_mb < 16:
            raise RewardError(f"code_tests: timeout ({timeout}) must be positive and memory_limit_mb "
                              f"({memory_limit_mb}) at least 16; set code_timeout / code_memory_limit_mb")
        self.timeout, self.memory_limit_mb = timeout, memory_limit_mb
        self.workers = workers or min(8, os.cpu_count() or 1)
        self.isolation = available_isolation()  # probe now, before training, not in the first batch

    def __call__(self, completions: list, tests: list, **_: Any) -> list[float | None]:
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(self.score, completions, tests))

    def score(self, completion: Any, tests: Any) -> float | None:
        test_code = code_of_tests(tests)
        if test_code is None:
            return None
        token = secrets.token_hex(16)
        result = run_python(HARNESS.format(program=program_of(completion), tests=test_code), stdin=token + "\n",
                            timeout=self.timeout, memory_limit_mb=self.memory_limit_mb, isolation=self.isolation)
        return 1.0 if result.ok and result.stdout.endswith("\n" + token + "\n") else 0.0
