"""Worker processes for the synchronous reward functions (``reward_num_workers``).

Workers are forked from the trainer's process, so they inherit the reward functions as they are:
lambdas, closures and functions loaded from a file (registered in ``sys.modules`` under a generated
name) all work, because no function is ever pickled; only the keyword arguments of a call and its
scores cross the pipe. Consequences of forking, and how they are handled:

* Forking happens after torch has run its CPU thread pool. The pool's threads do not exist in the
  child, and torch's OpenMP runtime hangs in a forked child that runs a multi-threaded op; so a
  worker first sets torch to one thread (as PyTorch's own DataLoader workers do). The worker loop
  itself never calls torch; a reward function that does (a small CPU model) then runs without
  hanging, and N workers do not oversubscribe the cores. CUDA cannot be used in a forked child, so
  reward models (``covey.rewards.reward_model``) always score in the trainer's process; a function of
  your own that runs a model on the GPU needs ``reward_num_workers: 0``.
* CPython re-initialises its own locks in the child and glibc's allocator is fork-safe, so the
  pure-Python worker loop cannot inherit a held lock; Python 3.12+'s warning about forking a
  multi-threaded process is silenced for that reason.
* State does not flow back: a reward function that counts calls or caches counts in its worker.

A call that exceeds the timeout is really stopped: its worker is killed (a hung thread in the
trainer's process could only be abandoned) and a fresh one is forked for the next call. A worker
that ends without being told (killed by the out-of-memory killer, say) is always noticed, whether it
was busy or idle: counted (``rewards/workers_lost``), warned about and replaced; the call it was
running is run once more in a new worker (a reward function is a function of its arguments), and a
call whose second worker ends too is a fault, handled as ``reward_errors`` says. Tools are not
run again (a tool may act on the world): the model reads the error. Each worker
closes its copies of the trainer's pipe ends, so it sees end-of-file and exits if the trainer's
process dies without closing the pool (killed by the out-of-memory killer, say). Each worker leads a
process group of its own, killed as one: processes a function started die with its worker.
"""

from __future__ import annotations

import collections
import inspect
import math
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from multiprocessing.util import Finalize
from typing import Any, Callable, Sequence

from covey.errors import ConfigError, RewardError
from covey.rewards.convention import reward_name
from covey.rewards.stoppable import WorkerFault, answer, become_worker, count, ended_how, fork, kill_group, worker_lost


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection  # the trainer's end of the pipe to this worker


class RewardPool:
    """``num_workers`` processes running the synchronous functions of ``reward_funcs``.

        with RewardPool(reward_funcs, 4) as pool:
            score_completions(reward_funcs, ..., pool=pool)

    Workers are started on first use, replaced when one is killed or dies, and stopped by
    ``close()`` (the pool can be used again afterwards; it then starts new workers). With
    ``num_workers=0`` the pool runs nothing and every function stays in the trainer's process.
    """

    def __init__(self, reward_funcs: Sequence[Callable], num_workers: int, group_size: int = 1, kind: str = "rewards",
                 retry_lost: bool = True):
        if num_workers > 0 and "fork" not in multiprocessing.get_all_start_methods():
            raise ConfigError(f"reward_num_workers={num_workers} needs processes started by fork, which this "
                              "platform lacks; set reward_num_workers: 0")
        self.reward_funcs, self.num_workers = tuple(reward_funcs), num_workers  # fixed: the workers inherit them
        self.group_size = group_size  # the batch is split between groups, so a call sees whole groups
        self.kind = kind  # what its functions are (rewards, tools): how its stopped calls are counted
        self.retry_lost = retry_lost  # a call whose worker ended under it is run once more in a new one
        self._workers: list[_Worker] = []
        # a pool dropped, or left open at exit, still stops its workers (before exit waits for child processes)
        Finalize(self, _stop, (self._workers, kind), exitpriority=10)

    def runs(self, func: Callable) -> bool:
        """Whether ``func`` runs in the workers: one of this pool's functions, not ``async``, and not one
        that must stay in the trainer's process (a reward model: ``in_trainer_process``)."""
        return (self.num_workers > 0 and not inspect.iscoroutinefunction(func) and any(f is func for f in self.reward_funcs)
                and not getattr(func, "in_trainer_process", False))

    def run(self, calls: list[tuple[Callable, dict]], timeout: float | None) -> list:
        """The outcome of each (function, keyword arguments) call, in order, spread over the workers:
        the return value, or the exception standing for the failure: a WorkerFault (the function
        raised, returned something that cannot be sent back, or its process died, twice when
        ``retry_lost``) or TimeoutError (the call ran over ``timeout`` seconds; its worker was killed)."""
        outcomes: list[Any] = [None] * len(calls)
        waiting = collections.deque((i, func, kwargs, self.retry_lost) for i, (func, kwargs) in enumerate(calls))
        busy: dict[Connection, tuple[_Worker, tuple, float]] = {}  # per worker: its call, its deadline
        try:
            while waiting or busy:
                self._replace_ended(idle=[w for w in self._workers if w.conn not in busy])
                for worker in list(self._workers):  # a worker found dead is dropped from the list
                    if waiting and worker.conn not in busy:
                        call = waiting.popleft()
                        if self._send(worker, call[1], call[2]):
                            busy[worker.conn] = (worker, call, time.monotonic() + (timeout or math.inf))
                        else:  # it ended as the call reached it
                            self._settle(call, self._lost(worker, call[3]), waiting, outcomes)
                if not busy:
                    continue
                deadline = min(d for _, _, d in busy.values())
                for conn in wait(list(busy), None if deadline == math.inf else max(0.0, deadline - time.monotonic())):
                    worker, call, _ = busy.pop(conn)
                    self._settle(call, self._receive(worker, call[3]), waiting, outcomes)
                for conn, (worker, (i, *_), deadline) in list(busy.items()):
                    if time.monotonic() >= deadline:
                        del busy[conn]
                        self._discard(worker)
                        count(self.kind, "stopped")
                        outcomes[i] = TimeoutError(f"no answer within {timeout}s; its worker process was killed")
        finally:  # interrupted: a busy worker's late reply would answer the wrong call
            for worker, _, _ in busy.values():
                self._discard(worker)
        return outcomes

    def close(self) -> None:
        """Stop the workers; one that does not stop within a second is killed."""
        _stop(self._workers, self.kind)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- workers --------------------------------------------------------------------------------

    def _start_missing(self) -> None:
        while len(self._workers) < self.num_workers:
            mine, theirs = multiprocessing.get_context("fork").Pipe()
            inherited = [w.conn for w in self._workers] + [mine]
            # not daemonic: a reward function may start processes of its own (daemons may not)
            process = fork(_serve, (self.reward_funcs, theirs, inherited), f"covey-{self.kind}-worker")
            theirs.close()  # only the worker holds its end: its death reads as end-of-file here
            self._workers.append(_Worker(process, mine))

    def start(self) -> None:
        """Start the workers now rather than at the first call (before the trainer runs threads)."""
        self._replace_ended(idle=list(self._workers))

    def _replace_ended(self, idle: list[_Worker]) -> None:
        """Replace the workers of ``idle`` that have ended (killed while waiting for a call), each
        counted and warned about, and start the missing ones."""
        for worker in idle:
            if wait([worker.process.sentinel], 0):  # ended, not reaped yet (its group is killed first)
                self._discard(worker, lost="it was waiting for a call; a new one replaces it")
        self._start_missing()

    def _send(self, worker: _Worker, func: Callable, kwargs: dict) -> bool:
        """Hand a call to an idle worker; False if the worker is gone."""
        index = next(j for j, f in enumerate(self.reward_funcs) if f is func)
        try:
            payload = ForkingPickler.dumps((index, kwargs))
        except Exception as e:  # pickling fails in many ways; all mean "this column cannot travel"
            raise RewardError(f"the batch for reward function {reward_name(func)!r} cannot be sent to "
                              f"a worker process ({type(e).__name__}: {e}); a dataset column holds values that do "
                              "not pickle: convert them, or set reward_num_workers: 0") from e
        try:
            worker.conn.send_bytes(payload)
        except OSError:
            return False
        return True

    def _receive(self, worker: _Worker, again: bool) -> Any:
        try:
            reply = worker.conn.recv()
        except (EOFError, OSError):
            return self._lost(worker, again)
        return reply[1] if reply[0] == "ok" else WorkerFault(reply[1], reply[2])

    def _lost(self, worker: _Worker, again: bool) -> WorkerFault:
        """The fault of a call whose worker process ended under it; the worker replaced, counted and
        warned about (``again``: the call is to be run once more)."""
        wait([worker.process.sentinel], 1)  # it closed the pipe by ending: let it finish ending
        self._discard(worker, lost="the call it was running is run again in a new worker" if again else
                      "a new one replaces it; the call it was running failed")
        how = ended_how(worker.process)
        return WorkerFault(f"ended its worker process ({how})", died=True, how=how)

    @staticmethod
    def _settle(call: tuple, outcome: Any, waiting: collections.deque, outcomes: list) -> None:
        """Record a call's outcome, or queue it once more when its worker ended under it and it may be retried."""
        i, func, kwargs, retry = call
        if retry and isinstance(outcome, WorkerFault) and outcome.died:
            waiting.appendleft((i, func, kwargs, False))
        else:
            outcomes[i] = outcome

    def _discard(self, worker: _Worker, lost: str = "") -> None:
        """Kill the worker and drop it from the pool; ``lost``: it had ended on its own, and what
        follows (counted and warned about)."""
        _kill(worker)  # its group first, then it is reaped: its exit code is read after
        self._workers.remove(worker)
        if lost:
            worker_lost(self.kind, ended_how(worker.process), lost)


def _stop(workers: list[_Worker], kind: str) -> None:
    ended = [w for w in workers if wait([w.process.sentinel], 0)]  # before being told to: lost
    for worker in workers:
        try:
            worker.conn.send(None)
        except OSError:
            pass
    for worker in workers:
        wait([worker.process.sentinel], 1)
        _kill(worker)
    for worker in ended:
        worker_lost(kind, ended_how(worker.process), "found as its pool closed")
    workers.clear()


def _kill(worker: _Worker) -> None:
    """Kill the worker and every process it started (its process group)."""
    kill_group(worker.process)
    worker.conn.close()


def _serve(reward_funcs: Sequence[Callable], conn: Connection, inherited: list[Connection]) -> None:
    """A worker's loop: answer (function index, keyword arguments) calls until told to stop."""
    for other in inherited:  # the trainer's pipe ends, copied by the fork
        other.close()
    become_worker()  # SIGINT and SIGTERM are the trainer's, which then closes the pool; torch on one thread
    try:
        while (call := conn.recv()) is not None:
            conn.send(answer(reward_funcs[call[0]], call[1]))
    except (EOFError, OSError):  # the trainer's process is gone
        pass

