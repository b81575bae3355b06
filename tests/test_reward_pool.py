"""Reward functions in worker processes (reward_num_workers): same scores, same fault handling."""

import json
import multiprocessing
import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from covey import GRPOTrainer
from covey.errors import RewardError
from covey.rewards.pool import RewardPool
from covey.rewards.stoppable import take_stop_counts
from covey.rewards import load_reward_func, score_completions
from tests.conftest import make_model
from tests.test_trainer import ROWS, count_a, small_args

B = 7
PROMPTS = [f"p{i}" for i in range(B)]
COMPLETIONS = ["fine", "ok", "boom", "fine too", "yes", "no", "last"]
IDS = [[i] * (i + 1) for i in range(B)]
COLUMNS = {"answer": [str(i) for i in range(B)], "level": list(range(10, 10 + B))}


def uses_every_column(prompts, completions, completion_ids, answer, level, **kwargs):
    return [len(p) + len(c) / 10 + len(ids) / 100 + int(a) * 1000 + lv * 1e5
            for p, c, ids, a, lv in zip(prompts, completions, completion_ids, answer, level)]


def worker_pid(completions, **kwargs):
    return [float(os.getpid())] * len(completions)


def explodes_on_boom(completions, **kwargs):
    if any("boom" in c for c in completions):
        raise ValueError("cannot parse")
    return [1.0] * len(completions)


def hangs_on_boom(completions, **kwargs):
    if any("boom" in c for c in completions):
        time.sleep(60)
    return [0.5] * len(completions)


def exits_on_boom(completions, **kwargs):
    if any("boom" in c for c in completions):
        os._exit(3)
    return [0.25] * len(completions)


def killed_on_boom(completions, **kwargs):
    if any("boom" in c for c in completions):
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.25] * len(completions)


def score(funcs, pool=None, **kwargs):
    return score_completions(funcs, PROMPTS, COMPLETIONS, IDS, COLUMNS, pool=pool, **kwargs)


def alive(pids):
    return {p.pid for p in multiprocessing.active_children()} & set(pids)


def test_scores_equal_the_in_process_scores_and_each_worker_gets_a_contiguous_chunk():
    offset = 0.5
    closure = lambda completions, **kw: [len(c) + offset for c in completions]  # noqa: E731
    funcs = [uses_every_column, closure, worker_pid]
    with RewardPool(funcs, 3) as pool:
        pooled = score(funcs[:2], pool)
        pids = score([worker_pid], pool)[:, 0].tolist()
    here = score(funcs[:2])
    assert torch.equal(pooled, here)
    assert pids == [pids[0]] * 2 + [pids[2]] * 2 + [pids[4]] * 3  # chunks of 2, 2, 3 rows, in order
    assert len(set(pids)) == 3 and os.getpid() not in pids


def test_chunks_hold_whole_groups():
    with RewardPool([worker_pid], 3, group_size=3) as pool:  # 7 rows are not groups of 3: single rows
        assert len(set(score([worker_pid], pool)[:, 0].tolist())) == 3
    completions = [f"c{i}" for i in range(6)]
    with RewardPool([worker_pid], 4, group_size=3) as pool:  # 6 rows = 2 groups: 2 chunks, not 4
        pids = score_completions([worker_pid], ["p"] * 6, completions, [[1]] * 6, {}, pool=pool)[:, 0].tolist()
    assert pids[:3] == [pids[0]] * 3 and pids[3:] == [pids[3]] * 3 and pids[0] != pids[3]


def test_async_functions_and_functions_of_another_pool_stay_in_this_process():
    async def doubled(completions, **kw):
        return [2.0 * len(c) for c in completions]

    with RewardPool([worker_pid], 2) as pool:
        table = score([doubled, worker_pid, lambda completions, **kw: [float(os.getpid())] * len(completions)], pool)
        assert not pool.runs(doubled)
    assert table[:, 0].tolist() == [2.0 * len(c) for c in COMPLETIONS]
    assert os.getpid() not in table[:, 1].tolist() and set(table[:, 2].tolist()) == {os.getpid()}


def test_a_raise_in_a_worker_is_attributed_to_its_sample_and_skip_matches_in_process():
    with RewardPool([explodes_on_boom], 2) as pool:
        with pytest.raises(RewardError, match=r"'explodes_on_boom' raised ValueError: cannot parse on completion 2: 'boom'") as caught:
            score([explodes_on_boom], pool)
        assert "in explodes_on_boom" in str(caught.value.__cause__.__cause__)  # the worker's traceback
        pooled_errors, here_errors = [], []
        pooled = score([explodes_on_boom], pool, on_error="skip", errors=pooled_errors)
    here = score([explodes_on_boom], on_error="skip", errors=here_errors)
    assert pooled_errors == here_errors == [("explodes_on_boom", 2, "raised ValueError: cannot parse")]
    assert torch.equal(pooled.isnan(), here.isnan()) and pooled.nan_to_num().equal(here.nan_to_num())


def test_a_hanging_call_is_killed_and_the_pool_recovers():
    errors = []
    with RewardPool([hangs_on_boom, worker_pid], 2) as pool:
        before = score([worker_pid], pool)[:, 0].tolist()
        start = time.perf_counter()
        table = score([hangs_on_boom], pool, on_error="skip", timeout=0.3, errors=errors)
        assert time.perf_counter() - start < 5
        assert table[:, 0].isnan().tolist() == [i == 2 for i in range(B)]
        assert errors == [("hangs_on_boom", 2, "took longer than reward_timeout=0.3s")]
        with pytest.raises(RewardError, match="'hangs_on_boom' took longer than reward_timeout=0.3s on completion 2"):
            score([hangs_on_boom], pool, timeout=0.3)
        after = score([worker_pid], pool)[:, 0].tolist()
        assert len(set(after)) == 2 and set(after) != set(before)  # the killed workers were replaced
        assert not alive(int(p) for p in before if p not in after)


def test_a_worker_that_dies_gives_a_clear_error_and_is_replaced():
    with RewardPool([exits_on_boom, killed_on_boom, worker_pid], 2) as pool:
        with pytest.raises(RewardError, match=r"'exits_on_boom' ended its worker process \(exit code 3\) on completion 2"):
            score([exits_on_boom], pool)
        errors = []
        table = score([exits_on_boom, killed_on_boom], pool, on_error="skip", errors=errors)
        assert len(set(score([worker_pid], pool)[:, 0].tolist())) == 2  # the lost workers were replaced
    assert errors == [("exits_on_boom", 2, "ended its worker process (exit code 3)"),
                      ("killed_on_boom", 2, f"ended its worker process (signal 9: {signal.strsignal(9)})")]
    assert table.nan_to_num(-1).tolist() == [[0.25, 0.25]] * 2 + [[-1, -1]] + [[0.25, 0.25]] * 4


def test_a_worker_killed_mid_call_is_noticed_replaced_and_its_call_run_again(tmp_path):
    """As the out-of-memory killer would: SIGKILL of a reward worker while it scores a batch."""
    started, killed = tmp_path / "started", tmp_path / "killed"

    def slow_the_first_time(completions, **kwargs):
        first = not killed.exists()
        with open(started, "a") as f:
            f.write(f"{os.getpid()}\n")
        if first:
            time.sleep(30)  # killed meanwhile
        return [float(len(c)) for c in completions]

    def kill_the_first_caller():
        deadline = time.monotonic() + 20
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        killed.touch()  # before the kill: the call run again must not sleep
        os.kill(int(started.read_text().split()[0]), signal.SIGKILL)

    take_stop_counts()
    killer = threading.Thread(target=kill_the_first_caller)
    with RewardPool([slow_the_first_time, worker_pid], 1) as pool:
        killer.start()
        start = time.perf_counter()
        with pytest.warns(RuntimeWarning, match=r"a rewards worker process ended \(signal 9: .*\) without being told to.*"
                                                r"run again in a new worker"):
            table = score([slow_the_first_time], pool)
        killer.join()
        assert time.perf_counter() - start < 20  # not the 30 s of the killed call
        assert table[:, 0].tolist() == [float(len(c)) for c in COMPLETIONS]  # the call run again, whole
        first, second = (int(p) for p in started.read_text().split())
        assert first != second and not running(first)
        assert set(score([worker_pid], pool)[:, 0].tolist()) == {second}  # one worker: the new one
    assert take_stop_counts()["rewards/workers_lost"] == 1


def test_a_worker_killed_while_idle_is_noticed_and_replaced_before_the_next_call():
    take_stop_counts()
    with RewardPool([worker_pid], 2) as pool:
        before = sorted(set(score([worker_pid], pool)[:, 0].tolist()))
        os.kill(int(before[0]), signal.SIGKILL)
        time.sleep(0.2)
        with pytest.warns(RuntimeWarning, match=r"rewards worker process ended \(signal 9: .*waiting for a call"):
            after = sorted(set(score([worker_pid], pool)[:, 0].tolist()))
    assert len(after) == 2 and before[1] in after and before[0] not in after
    assert take_stop_counts()["rewards/workers_lost"] == 1


def test_a_worker_killed_after_its_last_call_is_reported_as_the_pool_closes():
    pool = RewardPool([worker_pid], 1)
    pid = int(score([worker_pid], pool)[0, 0])
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    with pytest.warns(RuntimeWarning, match=r"rewards worker process ended \(signal 9: .*found as its pool closed"):
        pool.close()
    assert not running(pid)


def test_a_reward_loaded_from_a_file_runs_in_the_workers(tmp_path):
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent("""
        import os

        def length_and_pid(completions, **kwargs):
            return [len(c) + os.getpid() * 1000 for c in completions]
    """))
    func = load_reward_func(f"{tmp_path / 'user_rewards.py'}:length_and_pid")
    with RewardPool([func], 2) as pool:
        values = score([func], pool)[:, 0].tolist()
    assert [v % 1000 for v in values] == [len(c) for c in COMPLETIONS]
    assert os.getpid() not in {v // 1000 for v in values}


def torch_sum(completions, **kwargs):
    return [float((torch.ones(2_000_000) * len(c)).exp_().log_().sum()) for c in completions]


def test_a_reward_that_uses_torch_runs_in_a_worker_after_torch_used_its_threads():
    torch_sum(["warm the thread pool of this process"])  # a forked child must not wait on those threads
    with RewardPool([torch_sum], 2) as pool:
        pooled = score([torch_sum], pool, timeout=10)
    assert torch.equal(pooled, score([torch_sum]))


def test_close_leaves_no_process_and_the_pool_can_start_again():
    pool = RewardPool([worker_pid], 2)
    first = score([worker_pid], pool)[:, 0].tolist()
    assert len(alive(int(p) for p in first)) == 2
    pool.close()
    assert not alive(int(p) for p in first)
    second = score([worker_pid], pool)[:, 0].tolist()
    pool.close()
    assert not alive(int(p) for p in second) and not set(first) & set(second)


def _trainer_that_gets_killed(conn):
    pool = RewardPool([worker_pid], 2)
    conn.send(score([worker_pid], pool)[:, 0].tolist())
    os.kill(os.getpid(), signal.SIGKILL)


def running(pid):
    """Whether a process exists and has not exited (an exited orphan may linger as a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_workers_exit_when_the_trainers_process_is_killed():
    theirs, mine = multiprocessing.get_context("fork").Pipe()
    trainer = multiprocessing.get_context("fork").Process(target=_trainer_that_gets_killed, args=(theirs,))
    trainer.start()
    pids = {int(p) for p in mine.recv()}
    trainer.join()
    assert trainer.exitcode == -signal.SIGKILL and len(pids) == 2
    deadline = time.monotonic() + 5
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(p) for p in pids)


def test_a_trainer_with_two_workers_logs_the_same_metrics_as_without(tmp_path, tokenizer):
    runs = []
    for workers in (0, 2):
        out = tmp_path / f"workers{workers}"
        args = small_args(out, eval_max_samples=0, reward_num_workers=workers)
        trainer = GRPOTrainer(model=make_model(len(tokenizer)), reward_funcs=[count_a, "answer_format"], args=args,
                              train_dataset=ROWS, processing_class=tokenizer, quiet=True)
        pooled_calls, worker_pids, run = [], set(), trainer.parts.rewards.pool.run

        def recording_run(calls, timeout):
            pooled_calls.append(len(calls))
            outcomes = run(calls, timeout)
            worker_pids.update(w.process.pid for w in trainer.parts.rewards.pool._workers)
            return outcomes

        trainer.parts.rewards.pool.run = recording_run
        trainer.train()
        assert pooled_calls == ([4, 4] if workers else [])  # two functions in two chunks, once per generation round
        assert len(worker_pids) == workers and not alive(worker_pids) and not trainer.parts.rewards.pool._workers
        metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        runs.append([{k: v for k, v in m.items() if "time" not in k and k != "tokens_per_second"} for m in metrics])
    assert len(runs[0]) == 2 and runs[0] == runs[1]

