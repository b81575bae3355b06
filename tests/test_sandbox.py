"""The code sandbox and the code_tests reward, against correct, wrong and hostile programs.

Every hostile program must be contained, score 0, and leave this test process alive and unharmed with
no process of its own left behind. Tests that rely on namespaces skip, saying why, where the machine
does not allow them (on Linux as root, or with user namespaces, they run)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch

from covey import GRPOConfig, GRPOTrainer
from covey.rewards import sandbox
from covey.rewards.code import CodeTests, program_of, code_of_tests
from covey.errors import RewardError
from covey.rewards import load_reward_func
from covey.rollout import Rollout, SamplesWithPolicy
from covey.rewards.sandbox import Isolation, available_isolation, run_python
from covey.train.setup import builtin_reward_settings
from tests.conftest import make_model

TIMEOUT = 1.5
MARGIN = 10.0  # start-up and clean-up beyond the timeout: what it bounds never ends on its own, so a wide
# margin still shows the stop, and a machine busy with other work (CI, 2 cores) does not fail it
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-4, 4) == 0"
CORRECT = "```python\ndef add(a, b):\n    return a + b\n```"
INFINITE_LOOP = "def add(a, b):\n    while True:\n        pass\nadd(1, 2)"
FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
MEMORY_BOMB = "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))"
HUGE_OUTPUT = "while True:\n    print('x' * 10000)"


@pytest.fixture(scope="module")
def reward():
    return CodeTests(timeout=TIMEOUT, memory_limit_mb=256, workers=4)


@pytest.fixture(scope="module")
def namespaces():
    level = available_isolation()
    if level not in (Isolation.NAMESPACES, Isolation.USER_NAMESPACES):
        pytest.skip(f"needs Linux namespaces, which this machine does not allow (the sandbox uses {level.value})")
    return level


RUN_ID = uuid.uuid4().hex


@pytest.fixture(autouse=True)
def mark_sandbox_processes(monkeypatch):
    """Every process these tests start in a sandbox carries RUN_ID in its environment, so that a leftover
    is found wherever it was reparented to, and no process of anyone else is taken for one."""
    monkeypatch.setattr(sandbox, "PROGRAM_ENV", {**sandbox.PROGRAM_ENV, "COVEY_SANDBOX_RUN": RUN_ID})


def sandbox_leftovers() -> list[int]:
    """Live processes that a sandbox of these tests started: their environment has RUN_ID."""
    mark = f"COVEY_SANDBOX_RUN={RUN_ID}".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            environment = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state not in "ZX" and mark in environment:
            found.append(int(entry))
    return found


def assert_nothing_left():
    assert sandbox_leftovers() == []


# ---- the reward on ordinary programs -------------------------------------------------------------


def test_correct_wrong_and_broken_programs(reward):
    chat = [{"role": "assistant", "content": "Sure.\n```py\ndef add(a, b):\n    return b + a\n```\nThat is it."}]
    completions = [CORRECT, "def add(a, b):\n    return a - b", "def add(a, b) return a + b", chat,
                   "def add(a, b):\n    raise ValueError('no')", "print('solution')\ndef add(a, b):\n    return a + b"]
    assert reward(completions, [ADD_TESTS] * len(completions)) == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert_nothing_left()


def test_tests_may_be_a_list_of_asserts_and_rows_without_tests_score_none(reward):
    tests = [["assert add(1, 2) == 3", "assert add(2, 2) == 4"], ["assert add(1, 2) == 4"], "", []]
    assert reward([CORRECT] * 4, tests) == [1.0, 0.0, None, None]


def test_early_exits_and_printed_claims_do_not_pass(reward):
    cheats = ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "def add(a, b):\n    return 0\nquit()",
              "import os\nos.kill(os.getpid(), 9)",
              "import sys\nprint('All tests passed')\nsys.stdout.flush()\nimport os\nos._exit(0)",
              "def add(a, b):\n    raise SystemExit(0)"]
    assert reward(cheats, [ADD_TESTS] * len(cheats)) == [0.0] * len(cheats)


@pytest.mark.parametrize("tests", [
    "import unittest\nclass T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(1, 2), 3)\n"
    "if __name__ == '__main__':\n    unittest.main()",  # a guarded unittest file
    "import unittest\nclass T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(1, 2), 3)\n"
    "unittest.main()",  # unguarded: it must not end the process before the verdict
    "import unittest\nclass T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(1, 2), 3)",
    "def test_add():\n    assert add(1, 2) == 3",  # pytest style: only defined, never called by the file
])
def test_test_files_in_the_usual_formats_are_run_not_just_defined(reward, tests):
    wrong, exits = "def add(a, b):\n    return a - b", "import sys\ndef add(a, b):\n    sys.exit(0)"
    assert reward([CORRECT, wrong, exits], [tests] * 3) == [1.0, 0.0, 0.0]


def test_humaneval_checks_run_against_the_entry_point(reward):
    check = "def check(candidate):\n    assert candidate(1, 2) == 3"
    wrong = "def add(a, b):\n    return a - b"
    assert reward([CORRECT, wrong, "def plus(a, b):\n    return a + b"], [check] * 3,
                  entry_point=["add"] * 3) == [1.0, 0.0, 0.0]
    # an entry point named like a builtin is the program's own
    own_sorted = "def sorted(values):\n    return list(reversed(values))"
    assert reward([own_sorted], ["def check(candidate):\n    assert candidate([1, 2]) == [2, 1]"],
                  entry_point=["sorted"]) == [1.0]


def test_a_test_helper_with_parameters_is_called_by_the_tests_only(reward):
    tests = "def test_case(a, b, want):\n    assert add(a, b) == want\n\ntest_case(1, 2, 3)\ntest_case(2, 2, 4)"
    assert reward([CORRECT, "def add(a, b):\n    return a - b"], [tests] * 2) == [1.0, 0.0]


def test_patching_unittest_does_not_pass_its_tests(reward):
    tests = "import unittest\nclass T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(1, 2), 3)"
    wrong = "\ndef add(a, b):\n    return 0"
    cheats = ["import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None" + wrong,
              "import unittest\nclass R:\n    testsRun = 1\n    def wasSuccessful(self):\n        return True\n"
              "unittest.TextTestRunner.run = lambda self, test: R()" + wrong,
              "import sys, types\nfake = types.ModuleType('unittest')\nfake.TestCase = object\n"
              "fake.main = lambda *a, **k: None\nsys.modules['unittest'] = fake" + wrong,
              "import unittest\nunittest.TestResult.wasSuccessful.__code__ = (lambda self: True).__code__" + wrong,
              "import unittest, contextlib\n@contextlib.contextmanager\ndef swallow(self, *a, **k):\n"
              "    try:\n        yield\n    except Exception:\n        pass\n"
              "unittest.case._Outcome.testPartExecutor = swallow" + wrong]
    assert reward(cheats, [tests] * len(cheats)) == [0.0] * len(cheats)
    # what the program imports of unittest stays usable by the tests
    mocked = "import unittest.mock\nwith unittest.mock.patch('builtins.len', return_value=0):\n    assert add(1, 2) == 3"
    assert reward(["import unittest.mock\n" + CORRECT.strip("`").removeprefix("python\n")], [mocked]) == [1.0]


def test_replaced_builtins_do_not_fool_the_tests(reward):
    equals_anything = ("class Anything(int):\n    def __eq__(self, other):\n        return True\n"
                       "    __hash__ = int.__hash__\n")
    wrong = "\ndef add(a, b):\n    return 0"
    cheats = [
        "import builtins\n_c = builtins.compile\nbuiltins.compile = lambda s, f, m: _c('pass', f, m)" + wrong,
        "import builtins\nbuiltins.exec = lambda *args, **kwargs: None" + wrong,
        equals_anything + "type = lambda x: int\ndef add(a, b):\n    return Anything(0)",
        equals_anything + "import builtins\nbuiltins.type = lambda x: int\nbuiltins.isinstance = lambda x, t: True\n"
                          "def add(a, b):\n    return Anything(0)",
    ]
    typed = "r = add(1, 2)\nassert type(r) is int and isinstance(r, int) and r == 3"
    assert reward(cheats, [typed] * len(cheats)) == [0.0] * len(cheats)
    honest = "list = tuple\ndef sum(values):\n    return 0\ndef add(a, b):\n    return a + b + sum(list([a]))"
    python_own = "\nassert list('ab') == ['a', 'b'] and sum([1, 2]) == 3"  # the tests see Python's builtins
    unusual = "import builtins\nbuiltins.compile = builtins.exec = None\ndef add(a, b):\n    return a + b"
    assert reward([honest, unusual], [typed + python_own, typed]) == [1.0, 1.0]


def test_program_is_the_last_python_block_or_the_whole_text():
    assert program_of("a\n```python\nx = 1\n```\nthen\n```python\nx = 2\n```\n") == "x = 2\n"
    assert program_of("```\ny = 3\n```") == "y = 3\n"
    assert program_of("```python\nx = 1\n```\n```bash\nls\n```") == "x = 1\n"
    assert program_of("x = 4") == "x = 4"
    assert program_of([{"role": "assistant", "content": "```py\nz = 5\n```"}]) == "z = 5\n"
    indented = "1. The function:\n   ```python\n   def f():\n       return 1\n   ```\n"  # in a list item
    assert program_of(indented) == "def f():\n    return 1\n"
    assert program_of("~~~python\nw = 6\n~~~\n") == "w = 6\n"
    assert code_of_tests(["assert f()", "assert g()"]) == "assert f()\nassert g()"
    with pytest.raises(RewardError, match="tests must be Python code"):
        code_of_tests(42)


def test_programs_of_a_batch_run_concurrently():
    reward = CodeTests(timeout=5.0, memory_limit_mb=256, workers=4)
    sleeper = "import time\ntime.sleep(2.0)\ndef add(a, b):\n    return a + b"
    start = time.monotonic()
    assert reward([sleeper] * 4, [ADD_TESTS] * 4) == [1.0] * 4
    assert time.monotonic() - start < 6.0  # one after another it takes over 8 s


def test_settings_come_from_the_config():
    args = GRPOConfig(code_timeout=2.5, code_memory_limit_mb=128)
    func = load_reward_func("code_tests", builtin_reward_settings(args))
    assert isinstance(func, CodeTests) and (func.timeout, func.memory_limit_mb) == (2.5, 128)
    with pytest.raises(RewardError, match="code_timeout"):
        CodeTests(timeout=0)


# ---- hostile programs ------------------------------------------------------------------------------


def test_infinite_loop_is_stopped_at_the_timeout(reward):
    start = time.monotonic()
    assert reward([INFINITE_LOOP], [ADD_TESTS]) == [0.0]
    assert time.monotonic() - start < TIMEOUT + MARGIN
    result = run_python("while True:\n    pass", timeout=TIMEOUT, memory_limit_mb=256)
    assert result.status == "timeout" and result.seconds < TIMEOUT + MARGIN
    assert_nothing_left()


def test_fork_bomb_is_contained_and_leaves_no_process(reward):
    start = time.monotonic()
    assert reward([FORK_BOMB + "\ndef add(a, b):\n    return a + b"], [ADD_TESTS]) == [0.0]
    assert time.monotonic() - start < TIMEOUT + MARGIN
    assert_nothing_left()


def test_memory_bomb_is_stopped(reward):
    result = run_python(MEMORY_BOMB, timeout=5.0, memory_limit_mb=128)
    assert result.status == "memory" and result.returncode == 1
    assert reward([MEMORY_BOMB + "\ndef add(a, b):\n    return a + b"], [ADD_TESTS]) == [0.0]
    big = bytearray(50 * 2**20)  # this process can still allocate
    assert len(big) == 50 * 2**20


def test_environment_secrets_do_not_reach_the_program(reward, monkeypatch, namespaces):
    secret = f"covey-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("COVEY_TEST_SECRET", secret)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**os.environ, "COVEY_TEST_SECRET": secret})
    try:
        snoop = (f"import os\nfound = repr(dict(os.environ))\n"
                 f"for pid in ({os.getpid()}, {holder.pid}, {os.getppid()}):\n"
                 f"    try:\n        found += open(f'/proc/{{pid}}/environ').read()\n"
                 f"    except OSError as e:\n        print('blocked', pid, e)\n"
                 f"for pid in os.listdir('/proc'):\n"
                 f"    try:\n        found += open(f'/proc/{{pid}}/environ').read()\n"
                 f"    except OSError:\n        pass\n"
                 f"print(found)\n")
        result = run_python(snoop, timeout=TIMEOUT, memory_limit_mb=256)
        assert result.status == "ok", result.stderr
        assert secret not in result.stdout + result.stderr
        assert "COVEY_TEST_SECRET" not in result.stdout
        assert reward([snoop], ["assert 'covey-secret-' in found"]) == [0.0]
    finally:
        holder.kill()
        holder.wait()


def test_writes_outside_the_folder_do_not_happen(reward, tmp_path, namespaces):
    repo_file = Path(__file__).resolve().parent / f"written-by-sandbox-{uuid.uuid4().hex}"
    outside = tmp_path / "written-by-sandbox"
    for target in (repo_file, outside):
        writer = f"with open({str(target)!r}, 'w') as f:\n    f.write('x')\nwith open({str(target)!r}) as f:\n    ok = f.read() == 'x'"
        assert reward([writer], ["assert ok"]) == [0.0]
        assert not target.exists()
    result = run_python("open('scratch.txt', 'w').write('in the folder is fine')\nprint(open('scratch.txt').read())",
                        timeout=TIMEOUT, memory_limit_mb=256)
    assert result.stdout == "in the folder is fine\n"


def test_no_network_not_even_loopback(reward, namespaces):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    client = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
              f"s.sendall(b'leaked')\nsent = True")
    try:
        assert reward([client], ["assert sent"]) == [0.0]
        result = run_python(client, timeout=TIMEOUT, memory_limit_mb=256)
        assert result.status == "error" and "OSError" in result.stderr
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


def test_program_cannot_kill_the_trainer(reward, namespaces):
    me = os.getpid()
    # a process of this user beside the trainer, which kill(-1) would reach if the program could signal ours
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killer = (f"import os, signal\nfor attempt in (lambda: os.kill({me}, signal.SIGKILL),\n"
              f"                lambda: os.killpg(os.getpgid({me}), signal.SIGKILL),\n"
              f"                lambda: os.kill({bystander.pid}, signal.SIGKILL),\n"
              f"                lambda: os.kill(-1, signal.SIGKILL)):\n"
              f"    try:\n        attempt()\n    except OSError as e:\n        print('refused', e)\n"
              f"killed = True\n")
    try:
        result = run_python(killer, timeout=TIMEOUT, memory_limit_mb=256)
        assert result.stdout.count("refused") == 4
        assert reward([killer], ["assert killed"]) == [1.0]  # the program ran to its end
        assert bystander.poll() is None  # nothing of ours was hit
    finally:
        bystander.kill()
        bystander.wait()


def test_huge_output_is_capped_and_stopped(reward):
    start = time.monotonic()
    result = run_python(HUGE_OUTPUT, timeout=10.0, memory_limit_mb=256, output_limit_bytes=4096)
    assert result.status == "output_limit" and len(result.stdout) <= 4096
    assert time.monotonic() - start < 5.0  # stopped when over the cap, not at the timeout
    assert reward([HUGE_OUTPUT], [ADD_TESTS]) == [0.0]
    assert_nothing_left()


def test_background_processes_die_with_the_program():
    daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
              "    os._exit(0)\nprint('parent done')")
    for level in {available_isolation(), Isolation.LIMITS_ONLY}:
        result = run_python(daemon, timeout=TIMEOUT, memory_limit_mb=256, isolation=level)
        assert result.stdout == "parent done\n", (level, result)
        assert result.seconds < TIMEOUT  # its output closed when the program ended, not at the timeout
        assert_nothing_left()


def test_output_flood_after_starting_a_daemon_leaves_no_process():
    """Stopped at the output limit, the program is killed from outside: its daemon, in a session of
    its own, must go too."""
    flood = ("import os, time\nchild = os.fork()\nif child == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
             "        time.sleep(30)\n    os._exit(0)\nos.waitpid(child, 0)\nwhile True:\n    print('x' * 10000)")
    for level in {available_isolation(), Isolation.LIMITS_ONLY}:
        result = run_python(flood, timeout=10.0, memory_limit_mb=256, output_limit_bytes=4096, isolation=level)
        assert result.status == "output_limit" and result.seconds < 5.0, (level, result)
        assert_nothing_left()


def test_a_program_that_stops_the_sandbox_leaves_nothing_at_the_deadline():
    """In limits-only mode the program runs as the user of the sandbox's first process, so it can stop
    it; the caller then stops the run at its deadline and must kill the program's daemon itself."""
    stopper = ("import os, signal, time\nos.kill(os.getppid(), signal.SIGSTOP)\nif os.fork() == 0:\n    os.setsid()\n"
               "    if os.fork() == 0:\n        time.sleep(30)\n    os._exit(0)\ntime.sleep(30)")
    result = run_python(stopper, timeout=TIMEOUT, memory_limit_mb=256, isolation=Isolation.LIMITS_ONLY)
    assert result.status == "timeout" and result.seconds < TIMEOUT + sandbox.GRACE_SECONDS + MARGIN, result
    assert_nothing_left()


def test_a_chain_of_processes_that_keep_handing_over_is_caught(tmp_path):
    """Each process forks its successor and exits at once, in a session of its own: a look through
    /proc rarely finds one still alive, so the cleanup must go on until nothing is left, not stop at
    a look that found nothing. For the same reason each one touches a file where it can (not inside
    namespaces, where the kernel ends them), and the file must stay untouched. (The chain ends by
    itself after 20 s, should the cleanup fail.)"""
    beat = tmp_path / "beat"
    beat.touch()
    chain = (f"import os, time\nend = time.time() + 20\nif os.fork() == 0:\n    os.setsid()\n"
             f"    while time.time() < end:\n        if os.fork():\n            os._exit(0)\n"
             f"        try:\n            os.utime({str(beat)!r})\n        except OSError:\n            pass\n"
             f"    os._exit(0)\nprint('parent done')")
    for level in {available_isolation(), Isolation.LIMITS_ONLY}:
        result = run_python(chain, timeout=TIMEOUT, memory_limit_mb=256, isolation=level)
        assert (result.status, result.stdout) == ("ok", "parent done\n"), (level, result)
        assert result.seconds < TIMEOUT
        assert_nothing_left()
        last_beat = beat.stat().st_mtime_ns
        time.sleep(0.2)
        assert beat.stat().st_mtime_ns == last_beat, level


def test_copies_of_the_pipes_elsewhere_do_not_hold_up_the_result(monkeypatch):
    """A process that the caller forks while a sandbox starts (a reward worker, say) holds copies of
    the sandbox's pipes, so they do not close when the program ends; the result still comes at once."""
    holders = []
    real_popen = subprocess.Popen

    def popen_then_fork(*args, **kwargs):
        boot = real_popen(*args, **kwargs)
        holder = os.fork()
        if holder == 0:
            time.sleep(10)
            os._exit(0)
        holders.append(holder)
        return boot

    monkeypatch.setattr(sandbox.subprocess, "Popen", popen_then_fork)
    try:
        result = run_python("print('done')", timeout=5.0, memory_limit_mb=256)
    finally:
        for holder in holders:
            os.kill(holder, 9)
            os.waitpid(holder, 0)
    assert holders and (result.status, result.stdout) == ("ok", "done\n")
    assert result.seconds < 2.0


# ---- isolation levels -----------------------------------------------------------------------------


def test_namespaces_are_used_where_the_machine_allows_them():
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("namespaces as root need Linux and root")
    assert available_isolation() is Isolation.NAMESPACES
    result = run_python("import os\nprint(os.getuid(), os.getpid())", timeout=TIMEOUT, memory_limit_mb=256)
    uid, pid = map(int, result.stdout.split())
    assert result.isolation is Isolation.NAMESPACES and uid >= sandbox.FIRST_SANDBOX_UID and pid == 2


def test_weaker_fallback_is_announced_and_still_limits(monkeypatch):
    """When namespaces fail, the next level is chosen and a warning says what it does not protect."""
    real = sandbox.run_python

    def without_namespaces(source, **kwargs):
        if kwargs.get("isolation") in (Isolation.NAMESPACES, Isolation.USER_NAMESPACES):
            raise RewardError("namespaces refused")
        return real(source, **kwargs)

    monkeypatch.setattr(sandbox, "run_python", without_namespaces)
    available_isolation.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            level = available_isolation()
    finally:
        available_isolation.cache_clear()
    assert level in (Isolation.SEPARATE_USER, Isolation.LIMITS_ONLY)
    assert any(level.value in str(w.message) and level.gaps in str(w.message) for w in caught)

    secret = f"covey-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("COVEY_TEST_SECRET", secret)
    results = [real(src, timeout=TIMEOUT, memory_limit_mb=128, output_limit_bytes=4096, isolation=level)
               for src in ("while True:\n    pass", MEMORY_BOMB, HUGE_OUTPUT, "import os\nprint(dict(os.environ))")]
    assert [r.status for r in results] == ["timeout", "memory", "output_limit", "ok"]
    assert all(r.isolation is level for r in results)
    assert secret not in results[3].stdout
    assert_nothing_left()


def test_a_folder_tree_too_deep_for_rmtree_is_still_removed():
    before = set(Path(tempfile.gettempdir()).glob("covey-sandbox-*"))
    deep = "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')"
    result = run_python(deep, timeout=TIMEOUT, memory_limit_mb=256, isolation=Isolation.LIMITS_ONLY)
    assert result.stdout == "deep\n"
    assert set(Path(tempfile.gettempdir()).glob("covey-sandbox-*")) == before


def test_a_folder_rmtree_cannot_remove_is_removed_another_way(monkeypatch):
    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)  # as for a subfolder the program locked

    monkeypatch.setattr(sandbox.shutil, "rmtree", refused)
    with sandbox._working_folder() as folder:
        locked = Path(folder, "locked")
        locked.mkdir()
        (locked / "file").write_text("x")
        locked.chmod(0)
    assert not Path(folder).exists()


def _interpreter_for_everyone() -> str | None:
    """A Python that users other than its owner can run (the separate-user level needs one), or None."""
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        path = Path(os.path.realpath(candidate)) if candidate and os.path.exists(candidate) else None
        if path and all(p.stat().st_mode & 0o001 for p in [path, *path.parents]):
            return str(path)
    return None


def test_a_program_under_its_own_uid_leaves_no_files_or_shared_memory(monkeypatch):
    interpreter = _interpreter_for_everyone()
    if os.geteuid() != 0 or interpreter is None:
        pytest.skip("the separate-user level needs root and a Python every user can run")
    monkeypatch.setattr(sandbox, "INTERPRETER", interpreter)
    name = f"covey-left-{uuid.uuid4().hex}"
    program = textwrap.dedent(f"""
        import ctypes, os
        libc = ctypes.CDLL(None)
        for _ in range(3):  # System V shared memory: outlives the process, uncounted by its memory limit
            assert libc.shmget(0, 1 << 20, 0o1600) >= 0  # IPC_PRIVATE, IPC_CREAT | 0600
        for place in ("/tmp", "/dev/shm", "/var/tmp"):
            if os.access(place, os.W_OK):
                open(os.path.join(place, "{name}"), "w").write("left")
        print(os.getuid())
    """)
    result = run_python(program, timeout=TIMEOUT, memory_limit_mb=256, isolation=Isolation.SEPARATE_USER)
    uid = int(result.stdout)
    assert uid >= sandbox.FIRST_SANDBOX_UID
    rows = [row.split() for row in Path("/proc/sysvipc/shm").read_text().splitlines()]
    assert not [row for row in rows[1:] if int(dict(zip(rows[0], row))["uid"]) == uid]
    assert not [place for place in ("/tmp", "/dev/shm", "/var/tmp") if Path(place, name).exists()]


# ---- the trainer keeps running ----------------------------------------------------------------------


class ScriptedEngine(SamplesWithPolicy):
    """A rollout engine whose completions are fixed programs, cycled through the batch."""

    exact_logprobs = True

    def __init__(self, tokenizer, programs: list[str]):
        self.tokenizer, self.programs, self.calls = tokenizer, programs, 0

    def generate(self, prompt_ids, num_generations, params, seed=None) -> Rollout:
        rows = []
        for _ in range(len(prompt_ids) * num_generations):
            text = self.programs[self.calls % len(self.programs)]
            self.calls += 1
            rows.append(self.tokenizer.convert_tokens_to_ids(list(text)) + [self.tokenizer.eos_token_id])
        T = max(map(len, rows))
        ids = torch.full((len(rows), T), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        return Rollout(ids, mask, torch.zeros(ids.shape), ["eos"] * len(rows))


def test_trainer_keeps_running_through_hostile_completions(tmp_path, tokenizer, namespaces):
    me = os.getpid()
    hostile = [INFINITE_LOOP, FORK_BOMB, MEMORY_BOMB, "import os, signal\nos.kill(%d, signal.SIGKILL)" % me,
               "import sys\nsys.exit(0)", HUGE_OUTPUT, "def add(a, b):\n    return a - b"]
    programs = [CORRECT, *hostile]
    rows = [{"prompt": f"write add {i}", "tests": ADD_TESTS} for i in range(4)]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=4, per_device_train_batch_size=4,
                      gradient_accumulation_steps=2, max_completion_length=128, learning_rate=1e-3, eval_max_samples=0,
                      code_timeout=1.0, code_memory_limit_mb=128, logging_steps=1, log_completions=True)
    model = make_model(len(tokenizer))
    trainer = GRPOTrainer(model=model, reward_funcs=["code_tests"], args=args, train_dataset=rows,
                          processing_class=tokenizer, rollout_engine=ScriptedEngine(tokenizer, programs), quiet=True)
    trainer.train()
    run = tmp_path / "run"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    scored = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(scored) == 16
    for record in scored:
        expected = 1.0 if record["completion"] == CORRECT else 0.0
        assert record["rewards"]["code_tests"] == expected, record["completion"]
    assert {r["completion"] for r in scored} == set(programs)
    assert_nothing_left()
