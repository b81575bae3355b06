"""The ``code_tests`` reward: run the completion's Python against the dataset's tests in a sandbox.

A dataset row carries ``tests``: Python test code (asserts, a unittest file, pytest-style test
functions), or a list of statements; HumanEval-style ``check(candidate)`` tests need an
``entry_point`` column naming the function to check. The completion's program is its last fenced
Python block (without one, its last untagged block; without either, its whole text). The score is
1.0 when the program and then the tests run to their end in one sandboxed process, 0.0 otherwise;
rows without tests score None.

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
from covey.rewards.answers import completion_text
from covey.rewards.sandbox import available_isolation, run_python

# what opens a fenced block: three or more backticks and an optional language tag ("```python") ending
# a line, at its start or after some words ("Here is the code: ```python")
OPENING_FENCE = re.compile(r"(?:^|(?<=\s))(`{3,}|~{3,})[ \t]*([^`~\s]*)[ \t]*$")
PYTHON_TAGS = frozenset({"python", "python3", "py"})

# Runs the program, then the tests. The program's ``__name__`` is not "__main__", so its own
# ``if __name__ == "__main__":`` demo does not run (it would wait for input that never comes); the
# tests' is, so a guarded ``unittest.main()`` runs. What the harness uses after the program is bound
# before it; the tests run in a namespace of their own holding the program's definitions, less those
# that shadow a builtin, with a copy of the builtins taken before the program ran. So replacing
# ``compile``, ``exec``, ``type`` or ``isinstance``, by a global of the program or in the ``builtins``
# module, changes nothing for the tests; nor does patching ``unittest`` (its module, its classes'
# attributes), which is put back as it was before the tests run. After the tests' code, the test
# cases and the ``test*`` functions it defined run too (a file of pytest-style tests only defines
# them; one with parameters without defaults is a helper, not called), and with an entry point
# given, a HumanEval-style ``check(candidate)``; ``unittest.main()`` runs the cases without exiting.
HARNESS = """\
import builtins, os, sys, unittest


def _covey_harness(program, tests, entry_point):
    token = sys.stdin.readline().strip()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    compile_, exec_, flush, write, callable_ = compile, exec, sys.stdout.flush, os.write, callable
    isinstance_, issubclass_, function, case = isinstance, issubclass, type(lambda: 0), unittest.TestCase
    setattr_, delattr_, vars_, dict_, list_, len_, module = setattr, delattr, vars, dict, list, len, type(sys)
    loader, suite = unittest.TestLoader(), unittest.TestSuite
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=0)
    modules = {{name: module for name, module in sys.modules.items() if name.split(".")[0] == "unittest"}}
    kept = [unittest, unittest.case, case, unittest.case._Outcome, unittest.TestResult, unittest.TextTestResult,
            unittest.TextTestRunner, unittest.TestLoader, suite, unittest.suite.BaseTestSuite]
    saved = [(owner, dict_(vars_(owner))) for owner in kept]
    codes = [(f, f.__code__, f.__defaults__, f.__kwdefaults__) for _, attributes in saved
             for f in attributes.values() if isinstance_(f, function)]
    pristine = dict(vars(builtins))
    solution = {{"__name__": "solution"}}
    exec_(compile_(program, "solution.py", "exec"), solution)
    sys.modules.update(modules)
    for owner, attributes in saved:  # unittest as it was before the program (submodules it imported stay)
        for name in list_(vars_(owner)):
            if name not in attributes and not isinstance_(vars_(owner)[name], module):
                delattr_(owner, name)
        for name, value in attributes.items():
            if vars_(owner).get(name) is not value:
                setattr_(owner, name, value)
    for f, code, defaults, kwdefaults in codes:  # and its functions' code, which can be swapped in place
        f.__code__, f.__defaults__, f.__kwdefaults__ = code, defaults, kwdefaults
    checked = {{name: value for name, value in solution.items() if name not in pristine}}
    given = set(checked)
    checked.update(__builtins__=pristine, __name__="__main__")
    ran = []

    def cases_of_the_tests():
        return [value for name, value in list(checked.items()) if name not in given and isinstance_(value, type)
                and issubclass_(value, case) and value is not case and value not in ran]

    def run_cases(*args, **kwargs):
        cases = cases_of_the_tests()
        result = runner.run(suite([loader.loadTestsFromTestCase(c) for c in cases]))
        if not result.wasSuccessful() or result.testsRun == 0:
            raise AssertionError("the unittest cases did not pass")
        ran.extend(cases)

    unittest.main = run_cases
    exec_(compile_(tests, "tests.py", "exec"), checked)
    if cases_of_the_tests():
        run_cases()
    for name, value in list_(checked.items()):
        if name not in given and name.startswith("test") and isinstance_(value, function) and \
                value.__code__.co_argcount == len_(value.__defaults__ or ()):
            value()
    if entry_point is not None and callable_(checked.get("check")) and "check" not in given:
        checked["check"](checked[entry_point] if entry_point in checked else solution[entry_point])
    flush()
    write(1, ("\\n" + token + "\\n").encode())


_covey_harness({program!r}, {tests!r}, {entry_point!r})
"""


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, lowercased, or "" for none; code) of each fenced block (``` or ~~~), read line by
    line so that each opening fence pairs with its own closing fence. A block closes at a line that
    starts with at least as many fence characters (words after them are prose), or at a line of code
    ending in them ("x = 1```"); one left open runs to the end, unless nothing follows its fence. An
    indented fence (in a list item) takes as much indentation off each line of its code."""
    blocks: list[tuple[str, str]] = []
    fence, tag, code, indent = None, "", [], 0
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if fence is None:
            opening = OPENING_FENCE.search(stripped)
            if opening is not None:
                fence, tag, code = opening.group(1), opening.group(2).lower(), []
                indent = _indentation(line) if stripped.startswith(fence) else 0
        elif stripped.startswith(fence):
            blocks.append((tag, "".join(code)))
            fence = None
        elif stripped.endswith(fence):
            blocks.append((tag, "".join(code) + line[min(indent, _indentation(line)):].rstrip()[:-len(fence)]))
            fence = None
        else:
            code.append(line[min(indent, _indentation(line)):])
    if fence is not None and "".join(code).strip():
        blocks.append((tag, "".join(code)))
    return blocks


def _indentation(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


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
    (``covey.rewards.sandbox``) with ``timeout`` wall seconds and ``memory_limit_mb`` of memory; the batch's
    programs run concurrently, each in its own process, ``workers`` at a time."""

    __name__ = "code_tests"

    def __init__(self, timeout: float = 5.0, memory_limit_mb: int = 512, workers: int | None = None):
        if timeout <= 0 or memory_limit_mb < 16:
            raise RewardError(f"code_tests: timeout ({timeout}) must be positive and memory_limit_mb "
                              f"({memory_limit_mb}) at least 16; set code_timeout / code_memory_limit_mb")
        self.timeout, self.memory_limit_mb = timeout, memory_limit_mb
        self.workers = workers or min(8, os.cpu_count() or 1)
        self.isolation = available_isolation()  # probe now, before training, not in the first batch

    def __call__(self, completions: list, tests: list, entry_point: list | None = None, **_: Any) -> list[float | None]:
        entry_points = entry_point or [None] * len(completions)
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(self.score, completions, tests, entry_points))

    def score(self, completion: Any, tests: Any, entry_point: str | None = None) -> float | None:
        test_code = code_of_tests(tests)
        if test_code is None:
            return None
        token = secrets.token_hex(16)
        source = HARNESS.format(program=program_of(completion), tests=test_code, entry_point=entry_point or None)
        result = run_python(source, stdin=token + "\n",
                            timeout=self.timeout, memory_limit_mb=self.memory_limit_mb, isolation=self.isolation)
        return 1.0 if result.ok and result.stdout.endswith("\n" + token + "\n") else 0.0
