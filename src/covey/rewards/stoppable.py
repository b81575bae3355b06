"""Calls that can be stopped: a user's function (a reward function, a tool) run in a process of its
own, which is killed, with every process it started, once the call runs past its time limit.

A thread cannot be killed: a call left running in one keeps its core busy (a loop) or its thread
alive (a hang) for the rest of the run. So a call with a time limit runs in a child forked for it
(``call_in_child``) or in a worker process (``covey.rewards.pool``); the child leads a process group
of its own, and the whole group is killed after the call, whether it answered, ran over or died, so
no process it started outlives it. Forking copies the caller's memory: closures, lambdas and
functions loaded from files work (nothing is pickled but the arguments and the result), the call
reads the trainer's current state, but what it changes there (a counter, a cache) does not come
back. A function marked ``in_trainer_process = True`` stays in the trainer's process instead: a
call past its limit is then abandoned in a daemon thread, as the only choice left, and counted as
such.

Stopped and abandoned calls, and worker processes lost (ended without being told: killed from
outside, as by the out-of-memory killer, or exited), are counted per kind (``rewards``, ``tools``) and
read once per step (``take_stop_counts``), for the metrics ``rewards/stopped``, ``rewards/abandoned``,
``rewards/workers_lost`` and their ``tools/`` twins.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import pickle
import signal
import threading
import traceback
import warnings
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Callable

import torch
from covey.errors import warn

KINDS = ("rewards", "tools")
HOWS = ("stopped", "abandoned", "workers_lost")
LOGGERS = ("log_metric", "log_extra")  # a reward's keyword arguments that report to the trainer

_COUNTS: collections.Counter = collections.Counter()
_COUNTS_LOCK = threading.Lock()


class WorkerFault(Exception):
    """A call that failed in a child or worker process; ``str()`` says how, worded as for a call in the
    trainer's process ("raised ValueError: ..."), and the child's traceback is its cause."""

    def __init__(self, description: str, worker_traceback: str = "", died: bool = False, how: str = ""):
        super().__init__(description)
        self.died = died  # the process itself ended (killed from outside, or it exited), not the call raising
        self.how = how  # then how it ended ("signal 9: Killed", "exit code 3")
        if worker_traceback:
            self.__cause__ = _WorkerTraceback(worker_traceback)


class _WorkerTraceback(Exception):
    """The traceback of an exception raised in a child process, shown in the chain of the trainer's error."""


def count(kind: str, how: str) -> None:
    """One call of ``kind`` (rewards, tools) ``how`` (stopped, abandoned) past its time limit, or one of
    its worker processes lost (``workers_lost``)."""
    with _COUNTS_LOCK:
        _COUNTS[f"{kind}/{how}"] += 1


def take_stop_counts() -> dict[str, float]:
    """The calls stopped and abandoned, and the workers lost, since the last time this was asked, by metric name."""
    with _COUNTS_LOCK:
        taken = {f"{kind}/{how}": float(_COUNTS[f"{kind}/{how}"]) for kind in KINDS for how in HOWS}
        _COUNTS.clear()
    return taken


def worker_lost(kind: str, how_it_ended: str, what_next: str) -> None:
    """A worker process of ``kind`` found ended without being told to: counted (``<kind>/workers_lost``)
    and warned about, with ``what_next`` (the call run again, the worker replaced)."""
    count(kind, "workers_lost")
    warn(f"a {kind} worker process ended ({how_it_ended}) without being told to: killed from outside "
                  f"(the out-of-memory killer?) or exited (os._exit in the function?); {what_next}. Counted in "
                  f"{kind}/workers_lost", RuntimeWarning, stacklevel=3)


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def stays_in_process(func: Callable) -> bool:
    """Whether ``func`` is marked to run in the trainer's process (``in_trainer_process = True``)."""
    return bool(getattr(func, "in_trainer_process", False))


def answer(func: Callable, kwargs: dict) -> tuple:
    """("ok", value), or ("fault", description, traceback) for a raise or a value that does not pickle."""
    try:
        value = func(**kwargs)
    except Exception as e:  # the user's code: any exception is a fault, judged by the caller
        return "fault", f"raised {type(e).__name__}: {e}", traceback.format_exc()
    try:
        pickle.dumps(value)
    except Exception as e:  # as above: many exception types, one meaning
        return "fault", f"returned a {type(value).__name__} that cannot be sent back from its worker process ({e})", ""
    return "ok", value


def become_worker() -> None:
    """What a forked child does first: lead a process group of its own (killed as one), leave the
    trainer's signals to the trainer, and run torch on one thread (its OpenMP runtime hangs in a
    forked child that runs a multi-threaded op)."""
    os.setsid()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    torch.set_num_threads(1)


def fork(target: Callable, args: tuple, name: str) -> BaseProcess:
    process = multiprocessing.get_context("fork").Process(target=target, args=args, name=name)
    with warnings.catch_warnings():  # the child runs no other thread's code and takes none of its locks
        warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
        process.start()
    return process


def kill_group(process: BaseProcess) -> None:
    """Kill ``process`` and every process of its group (what it started), then reap it. The group is
    killed before the leader is reaped, so that its number cannot have been given to another."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone (or the child had not yet made it)
        if process.is_alive():
            process.kill()
    process.join()


def ended_how(process: BaseProcess) -> str:
    code = process.exitcode
    return f"signal {-code}: {signal.strsignal(-code)}" if code is not None and code < 0 else f"exit code {code}"


def call_in_child(func: Callable, kwargs: dict, timeout: float, kind: str = "rewards") -> Any:
    """``func(**kwargs)`` in a forked child, within ``timeout`` seconds; its value. A raise, or a
    child that dies, is raised here as a WorkerFault; a call past ``timeout`` as TimeoutError, its
    child (and all it started) killed and the stop counted. Calls to ``log_metric`` / ``log_extra``
    among ``kwargs`` are made in the child and replayed here, in order, after it answers."""
    theirs, mine = multiprocessing.get_context("fork").Pipe(duplex=False)
    process = fork(_child, (func, kwargs, mine, theirs), f"covey-{kind}-call")
    mine.close()  # only the child holds the sending end: its death reads as end-of-file here
    reply = None
    try:
        if not theirs.poll(timeout):
            count(kind, "stopped")
            raise TimeoutError(f"no answer within {timeout}s; the call was stopped")
        try:
            reply = theirs.recv()
        except (EOFError, OSError):  # it died before answering
            pass
        if reply is not None:
            wait([process.sentinel], 5)  # it exits once it has answered
    finally:
        kill_group(process)
        theirs.close()
    if reply is None:
        raise WorkerFault(f"ended its process ({ended_how(process)})", died=True, how=ended_how(process))
    status, *rest, logs = reply
    for name, args in logs:
        kwargs[name](*args)
    if status != "ok":
        raise WorkerFault(*rest)
    return rest[0]


def _child(func: Callable, kwargs: dict, conn: Connection, other: Connection) -> None:
    other.close()
    become_worker()
    logs: list = []

    def recorder(name: str) -> Callable:
        return lambda *args: logs.append((name, args))

    kwargs = {k: recorder(k) if k in LOGGERS and callable(v) else v for k, v in kwargs.items()}
    reply = answer(func, kwargs)
    try:
        conn.send((*reply, logs))
    except Exception as e:  # a logged value that does not pickle
        conn.send(("fault", f"logged a value that cannot be sent back from its process ({e})", "", []))


def call_in_thread(func: Callable, kwargs: dict, timeout: float, kind: str, name: str) -> Any:
    """``func(**kwargs)`` in a daemon thread, waited for ``timeout`` seconds; past it TimeoutError,
    the call abandoned (it runs on: a thread cannot be stopped) and counted as such. For functions
    that stay in the trainer's process, and platforms without fork."""
    outcome: list = []

    def call() -> None:
        try:
            outcome.append((True, func(**kwargs)))
        except BaseException as e:  # handed to the caller as it is
            outcome.append((False, e))

    thread = threading.Thread(target=call, name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        count(kind, "abandoned")
        raise TimeoutError(f"no answer within {timeout}s; the call was left running in the trainer's process")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
