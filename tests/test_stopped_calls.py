"""Reward and tool calls past their time limit are stopped, not abandoned: after each stop the trainer's
threads, child processes and CPU use are back where they were, the stops are counted, and the next
call works."""

import gc
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from covey import GRPOTrainer
from covey.agents.tools import ToolWorkers, as_tool, calculate, call_tool
from covey.errors import RewardError
from covey.rewards import score_completions
from covey.rewards.stoppable import take_stop_counts
from tests.conftest import make_model
from tests.test_agents import ScriptedAgent, trainer_with
from tests.test_trainer import ROWS, small_args

LIMIT = 0.3


def child_processes() -> set[int]:
    """The processes whose parent is this one (from /proc)."""
    me, found = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cpu_seconds_while_idle(seconds: float = 1.0) -> float:
    """The CPU time this process (all its threads) spends while its main thread sleeps ``seconds``."""
    start = time.process_time()
    time.sleep(seconds)
    return time.process_time() - start


class Level:
    """The threads and child processes of this process now, to compare with later."""

    def __init__(self):
        self.threads, self.children = threading.active_count(), child_processes()

    def assert_back(self, replaced: bool = False):
        """``replaced``: a worker process among the children was killed, and replaced by a new one."""
        assert threading.active_count() == self.threads
        now = child_processes()
        assert len(now) == len(self.children) and (now != self.children) == replaced, (self.children, now)
        assert cpu_seconds_while_idle() < 0.1  # nothing of the stopped call still runs here


def spins(completions, **kwargs):
    while True:
        pass


def hangs(completions, **kwargs):
    time.sleep(600)


def forks_a_spinner(completions, pid_file, **kwargs):
    """Starts a process of its own that spins (and would outlive a call that is merely abandoned)."""
    pid = os.fork()
    if pid == 0:
        while True:
            pass
    Path(pid_file[0]).write_text(str(pid))
    time.sleep(600)


@pytest.mark.parametrize("func", [spins, hangs], ids=["spins", "hangs"])
def test_reward_calls_past_the_limit_are_stopped_and_leave_nothing_running(func):
    take_stop_counts()
    level = Level()
    for _ in range(4):
        errors = []
        start = time.monotonic()
        table = score_completions([func], ["p"], ["c"], [[1]], {}, on_error="skip", timeout=LIMIT, errors=errors)
        assert time.monotonic() - start < 10  # the batch call and the one retried alone, each stopped at the limit
        assert table.isnan().all() and errors == [(func.__name__, 0, f"took longer than reward_timeout={LIMIT}s")]
        level.assert_back()
    assert take_stop_counts()["rewards/stopped"] == 8  # 4 batches, each called whole and then one completion alone
    with pytest.raises(RewardError, match=rf"'{func.__name__}' took longer than reward_timeout={LIMIT}s on completion 0"):
        score_completions([func], ["p"], ["c"], [[1]], {}, timeout=LIMIT)
    level.assert_back()


def test_processes_a_stopped_reward_started_are_killed_with_it(tmp_path):
    level = Level()
    pid_file = tmp_path / "pid"
    score_completions([forks_a_spinner], ["p"], ["c"], [[1]], {"pid_file": [str(pid_file)]}, on_error="skip",
                      timeout=LIMIT)
    assert gone(int(pid_file.read_text()))
    level.assert_back()


def test_a_reward_call_within_the_limit_gives_its_scores_and_its_logs():
    logged = []
    offset = 0.25

    def scores(completions, log_metric, **kwargs):
        log_metric("seen", float(len(completions)))
        return [len(c) + offset for c in completions]

    context = {"log_metric": lambda name, value: logged.append((name, value)), "log_extra": lambda *a: None}
    table = score_completions([scores], ["p", "q"], ["ab", "c"], [[1], [2]], {}, timeout=30.0, context=context)
    assert table[:, 0].tolist() == [2.25, 1.25] and logged == [("seen", 2.0)]


def test_the_reward_call_before_training_honours_reward_timeout(tmp_path, tokenizer):
    calls = []

    def spins_at_first(completions, **kwargs):
        calls.append(1)
        while True:
            pass

    args = small_args(tmp_path, reward_timeout=1.0)
    level = Level()
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"'spins_at_first' did not answer within reward_timeout=1.0s .* before "
                                          r"training .* stopped"):
        GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[spins_at_first], args=args, train_dataset=ROWS,
                    processing_class=tokenizer, quiet=True)
    assert time.monotonic() - start < 30  # the limit, and the trainer's own set-up around it
    assert not calls  # called in the child, which was stopped
    level.assert_back()


# ---- tools --------------------------------------------------------------------------------------------------


def spin(n: int) -> str:
    """Spin.

    Args:
        n: ignored
    """
    while True:
        pass


def sleep(n: int) -> str:
    """Sleep.

    Args:
        n: ignored
    """
    time.sleep(600)
    return "late"


def fork_and_spin(n: int, path: str) -> str:
    """Start a process that spins, and wait.

    Args:
        n: ignored
        path: where its process number is written
    """
    pid = os.fork()
    if pid == 0:
        while True:
            pass
    Path(path).write_text(str(pid))
    time.sleep(600)
    return "late"


def flood(n: int) -> str:
    """Return n MiB of text.

    Args:
        n: MiB
    """
    return "x" * (n << 20)


def gone(pid: int) -> bool:
    for _ in range(50):  # a killed orphan is reaped by whoever adopted it
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_tool_calls_past_the_limit_are_stopped_the_worker_replaced_and_nothing_left_running(tmp_path):
    tools = [as_tool(f) for f in (spin, sleep, fork_and_spin, calculate, flood)]
    workers = ToolWorkers(tools)
    try:
        level = Level()  # the worker is running already
        assert len(level.children) >= 1
        take_stop_counts()
        for tool in tools[:3] * 2:
            pid_file = tmp_path / "pid"
            result = call_tool(tool, {"n": 1, **({"path": str(pid_file)} if tool.name == "fork_and_spin" else {})},
                               LIMIT, workers)
            assert result.failed and result.text == f"error: {tool.name} did not answer within {LIMIT:g} s"
            if tool.name == "fork_and_spin":  # what the tool started was killed with its worker
                assert gone(int(pid_file.read_text()))
            level.assert_back(replaced=True)
            level = Level()
            assert call_tool(tools[3], {"expression": "6 * 7"}, LIMIT, workers).text == "42"
        assert take_stop_counts()["tools/stopped"] == 6
        assert len(call_tool(tools[4], {"n": 8}, 30.0, workers).text) == 8 << 20
    finally:
        workers.close()


def test_a_tool_that_raises_or_exits_in_its_worker_gives_the_model_an_error():
    def broken(n: int) -> str:
        """Raise.

        Args:
            n: ignored
        """
        raise ValueError(f"no {n}")

    def exits(n: int) -> str:
        """Exit its process.

        Args:
            n: ignored
        """
        os._exit(3)

    tools = [as_tool(broken), as_tool(exits), as_tool(calculate)]
    workers = ToolWorkers(tools)
    take_stop_counts()
    try:
        assert call_tool(tools[0], {"n": 2}, LIMIT, workers).text == "error: broken raised ValueError: no 2"
        with pytest.warns(RuntimeWarning, match=r"a tools worker process ended \(exit code 3\).*the call it was running failed"):
            assert call_tool(tools[1], {"n": 2}, LIMIT, workers).text == "error: exits ended its worker process (exit code 3)"
        assert take_stop_counts()["tools/workers_lost"] == 1  # not run again: one loss, not two
        assert call_tool(tools[2], {"expression": "2 + 2"}, LIMIT, workers).text == "4"
    finally:
        workers.close()


def test_a_tool_marked_to_stay_in_the_trainer_s_process_runs_there_and_is_only_abandoned():
    release = threading.Event()

    def shares_memory(n: int) -> str:
        """Wait for the test.

        Args:
            n: ignored
        """
        release.wait(600)
        return str(os.getpid())

    shares_memory.in_trainer_process = True
    tool = as_tool(shares_memory)
    workers = ToolWorkers([tool, as_tool(calculate)])
    try:
        take_stop_counts()
        threads = threading.active_count()
        assert call_tool(tool, {"n": 1}, LIMIT, workers).failed
        assert threading.active_count() == threads + 1  # what it gives up: the call runs on, in a thread
        assert take_stop_counts()["tools/abandoned"] == 1
        release.set()
        assert call_tool(tool, {"n": 1}, LIMIT, workers).text == str(os.getpid())
    finally:
        release.set()
        workers.close()


def test_a_run_counts_its_stopped_tool_and_reward_calls_and_goes_on(tmp_path, tokenizer):
    def slow_on_batches(completions, **kwargs):
        if len(completions) > 2:  # the batches of training; each completion alone (and the check before) fine
            time.sleep(600)
        return [1.0] * len(completions)

    engine = ScriptedAgent(tokenizer, '<tool_call>{{"name": "sleep", "arguments": {{"n": {a}}}}}</tool_call>')
    level = Level()
    trainer = trainer_with(tmp_path, tokenizer, engine, config=dict(tool_timeout=LIMIT, reward_timeout=LIMIT,
                                                                    reward_errors="skip", max_steps=2),
                           tools=[sleep], reward_funcs=[slow_on_batches])
    with pytest.warns(UserWarning, match="took longer than reward_timeout"):
        trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "tools/stopped" in m]
    assert len(steps) == 2 and all(m["tools/stopped"] >= 1 for m in steps)
    assert sum(m["rewards/stopped"] for m in steps) >= 1 and all(m["tools/abandoned"] == 0 for m in steps)
    del trainer
    gc.collect()  # the tool worker goes with the trainer
    level.assert_back()


def test_a_reward_whose_process_is_killed_says_what_happened_and_how_to_go_on():
    def killed(completions, **kwargs):  # as the out-of-memory killer would
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(RewardError, match=r"'killed' ended its process \(signal 9: Killed\) on completion 0: 'c'; its "
                                          r"process was killed from outside .* --resume-from-checkpoint auto"):
        score_completions([killed], ["p"], ["c"], [[1]], {}, timeout=30.0)
