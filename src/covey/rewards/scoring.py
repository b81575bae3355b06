"""Scoring a batch: every reward function called on it (async ones concurrently, the others in this
process or the worker pool), the values checked, and a failing function retried one completion at a
time to name the culprit; and the check before any model loads that each function takes the call."""

from __future__ import annotations

import asyncio
import collections.abc
import concurrent.futures
import inspect
import math
import warnings
from typing import Any, Iterator, Sequence

import torch

from covey.errors import RewardError, warn
from covey.rewards.answers import completion_text
from covey.rewards.convention import (RewardFunc, TrainerState, check_reward_signature, reward_context, reward_name,
                                      without_logging)
from covey.rewards.pool import RewardPool
from covey.rewards.stoppable import WorkerFault, call_in_child, call_in_thread, can_fork, stays_in_process, worker_lost


def _logged_in_a_worker(*_: Any) -> None:
    """``log_metric`` / ``log_extra`` in a reward worker process, which cannot reach the trainer."""
    warn("a reward function called log_metric or log_extra in a reward worker process, which cannot pass "
                  "them to the trainer: not logged. Set reward_num_workers: 0 to log them", stacklevel=2)


def _context_for(func: RewardFunc, context: dict[str, Any], pool: RewardPool | None) -> dict[str, Any]:
    """``context`` as ``func`` gets it: in a worker process the loggers cannot reach the trainer."""
    return without_logging(context, _logged_in_a_worker) if pool is not None and pool.runs(func) else context


def call_reward(func: RewardFunc, kwargs: dict, timeout: float | None) -> Any:
    """One call, within ``timeout`` seconds when set: then in a forked child process that is killed
    past it (``covey.rewards.stoppable``), unless ``func`` stays in the trainer's process
    (``in_trainer_process``) or the platform cannot fork: then in a daemon thread, abandoned past it.
    A child that ends under the call (killed from outside) is counted and the call run once more."""
    if inspect.iscoroutinefunction(func):
        return run_coroutine(asyncio.wait_for(func(**kwargs), timeout))
    if timeout is None:
        return func(**kwargs)
    if can_fork() and not stays_in_process(func):
        try:
            return call_in_child(func, kwargs, timeout, "rewards")
        except WorkerFault as e:  # its child ended under it (killed from outside?): counted, and run once more
            if not e.died:
                raise
            worker_lost("rewards", e.how, "the call is run again in a new child")
            return call_in_child(func, kwargs, timeout, "rewards")
    return call_in_thread(func, kwargs, timeout, "rewards", f"reward-{reward_name(func)}")


def run_coroutine(coroutine: Any) -> Any:
    """``asyncio.run(coroutine)``, also where an event loop already runs in this thread (a notebook):
    then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as runner:
        return runner.submit(asyncio.run, coroutine).result()


def _call_all(reward_funcs: Sequence[RewardFunc], kwargs: dict, timeout: float | None, pool: RewardPool | None,
              context: dict[str, Any]) -> list:
    """Each function's result or the exception it raised. Async functions run concurrently; the
    functions the pool runs are split into one contiguous chunk of the batch per worker."""
    results: list[Any] = [None] * len(reward_funcs)
    asynchronous = [j for j, f in enumerate(reward_funcs) if inspect.iscoroutinefunction(f)]
    if asynchronous:
        async def gather():
            return await asyncio.gather(*(asyncio.wait_for(reward_funcs[j](**kwargs, **context), timeout)
                                          for j in asynchronous), return_exceptions=True)
        for j, result in zip(asynchronous, run_coroutine(gather())):
            results[j] = result
    pooled = [j for j, f in enumerate(reward_funcs) if pool is not None and pool.runs(f)]
    if pooled:
        chunks = _chunks(kwargs, pool.num_workers, pool.group_size)
        outcomes = pool.run([(reward_funcs[j], {**chunk, **_context_for(reward_funcs[j], context, pool)})
                             for j in pooled for chunk in chunks], timeout)
        for n, j in enumerate(pooled):
            results[j] = _joined(outcomes[n * len(chunks):(n + 1) * len(chunks)])
    for j, func in enumerate(reward_funcs):
        if j not in asynchronous and j not in pooled:
            results[j] = next(_outcomes(func, [{**kwargs, **context}], timeout, None))
    return results


def _chunks(batch: dict, n: int, group_size: int = 1) -> list[dict]:
    """The batch cut into at most ``n`` contiguous, non-empty, near-equal slices of every column, each
    made of whole groups of ``group_size`` rows (single rows when the batch is not made of groups)."""
    B = len(batch["completions"])
    unit = group_size if group_size > 0 and B % group_size == 0 else 1
    parts = min(n, B // unit)
    bounds = [B // unit * k // parts * unit for k in range(parts + 1)] if B else []
    return [{key: column[a:b] for key, column in batch.items()} for a, b in zip(bounds, bounds[1:])]


def _joined(parts: list) -> Any:
    """The chunks' outcomes as one: the first failure, else the concatenated scores (a chunk that
    returned no list stands for the whole call, for validation to report)."""
    failure = next((p for p in parts if isinstance(p, BaseException)), None)
    if failure is not None:
        return failure
    parts = [returned_values(p) for p in parts]
    wrong = next((p for p in parts if not isinstance(p, (list, tuple))), None)
    return wrong if wrong is not None else [value for part in parts for value in part]


def _outcomes(func: RewardFunc, calls: list[dict], timeout: float | None, pool: RewardPool | None) -> Iterator[Any]:
    """Each call's result or the exception it raised, in order: all at once over the pool's workers
    when the pool runs ``func``, else one after another in this process."""
    if pool is not None and pool.runs(func):
        yield from pool.run([(func, kwargs) for kwargs in calls], timeout)
        return
    for kwargs in calls:
        try:
            yield call_reward(func, kwargs, timeout)
        except Exception as e:  # the user's code: any exception is a reward fault
            yield e


def _describe(e: BaseException, timeout: float | None) -> str:
    if isinstance(e, WorkerFault):  # worded in the worker
        return str(e)
    if isinstance(e, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)):
        return f"took longer than reward_timeout={timeout}s"
    return f"raised {type(e).__name__}: {e}"


def _how_to_go_on(e: BaseException) -> str:
    if isinstance(e, WorkerFault) and e.died:
        return ("its process was killed from outside (the out-of-memory killer?) or exited (os._exit in the "
                "function?): give it more memory (or set fewer reward_num_workers), then go on from the last "
                "checkpoint with --resume-from-checkpoint auto")
    return "fix the function, or set reward_errors: skip to score such samples as None"


def score_completions(
    reward_funcs: Sequence[RewardFunc],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    on_error: str = "raise",
    timeout: float | None = None,
    errors: list | None = None,
    pool: RewardPool | None = None,
    context: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Call every reward function on the batch; (B, F) float64 with NaN where a function said None.
    ``context``: the keyword arguments of every call beside the columns (``reward_context``).

    A function that raises or exceeds ``timeout`` is called again one completion at a time to find
    the culprit: ``on_error="raise"`` stops with an error naming the function, the sample and its
    text; ``"skip"`` makes each failing sample's reward None and appends (function, index, reason)
    to ``errors``. The synchronous functions of ``pool`` run in its worker processes, each worker
    scoring one contiguous chunk of the batch; the result is the same as in this process.
    """
    B = len(completions)
    table = torch.full((B, len(reward_funcs)), math.nan, dtype=torch.float64)
    batch = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    context = context or {}
    for j, (func, values) in enumerate(zip(reward_funcs, _call_all(reward_funcs, batch, timeout, pool, context))):
        name = reward_name(func)
        if isinstance(values, BaseException):
            values = _one_by_one(func, batch, B, on_error, timeout, errors, values, pool, context)
        for i, value in enumerate(checked_values(values, name, B)):
            if value is not None:
                table[i, j] = reward_value(value, name, i)
    if reward_funcs and torch.isnan(table).all(1).any():  # one message, so that it is shown once
        unscored = int(torch.isnan(table).all(1).nonzero()[0])  # TRL's words, then the first such completion
        warn("All reward functions returned None for the following kwargs: "
             f"{ {k: v[unscored] for k, v in batch.items() if isinstance(v, list) and len(v) == B} }. Those "
             "completions get no reward and no advantage (metrics: reward is the mean of the others); make sure at "
             "least one reward function scores every completion", stacklevel=2)
    return table


def checked_values(values: Any, name: str, B: int) -> list:
    """What reward function ``name`` returned for ``B`` completions as a list of B values; a RewardError
    where it is not one value per completion."""
    values = returned_values(values)
    if not isinstance(values, (list, tuple)) or len(values) != B:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise RewardError(f"reward function {name!r} returned {got} for {B} completions; it must return one "
                          "float (or None) per completion, as a list, tuple, numpy array or tensor")
    return list(values)


def returned_values(values: Any) -> Any:
    """What a reward function returned as a list where it is a sequence of values: a list or tuple as it
    is, a numpy array, tensor or pandas Series by its ``.tolist()``, any other sequence but text by
    ``list()``; anything else (a scalar, a string) unchanged, for the caller to reject."""
    if isinstance(values, (list, tuple, str, bytes)):
        return values
    if callable(getattr(values, "tolist", None)):
        try:
            listed = values.tolist()
        except Exception:  # a tolist that is not numpy's: the value is judged as it is
            return values
        return listed if isinstance(listed, list) else values  # a 0-d array or numpy scalar lists to a scalar
    return list(values) if isinstance(values, collections.abc.Sequence) else values


def reward_value(value: Any, name: str, i: int) -> float:
    """``value``, returned by reward function ``name`` for completion ``i``, as a finite float: any real
    number float() takes (bool, int, float, a numpy scalar, a one-element tensor), but not text."""
    try:
        number = None if isinstance(value, (str, bytes)) else float(value)
    except (TypeError, ValueError, OverflowError, RuntimeError):  # not a number, or an int beyond a float
        number = None
    if number is None or not math.isfinite(number):
        try:
            shown = repr(value)
        except ValueError:  # an int too long to print
            shown = f"an int of {value.bit_length()} bits"
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise RewardError(f"reward function {name!r} returned {shown} ({type(value).__name__}) for completion {i}; "
                          "expected a finite real number (float, int, bool, numpy scalar, one-element tensor) or None")
    return number


def _one_by_one(func, batch: dict, B: int, on_error: str, timeout: float | None, errors: list | None,
                batch_error: BaseException, pool: RewardPool | None, context: dict[str, Any]) -> list:
    name, values, failed = reward_name(func), [], False
    shared = without_logging(context)  # a retry is not the batch: it logs nothing
    singles = [{**{k: v[i:i + 1] for k, v in batch.items()}, **shared} for i in range(B)]
    for i, outcome in enumerate(_outcomes(func, singles, timeout, pool)):
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            values.append(outcome[0])
        except Exception as e:
            text = completion_text(batch["completions"][i])
            if on_error == "raise":
                raise RewardError(f"reward function {name!r} {_describe(e, timeout)} on completion {i}: {text[:200]!r}; "
                                  f"{_how_to_go_on(e)}") from e
            failed = True
            values.append(None)
            if errors is not None:
                errors.append((name, i, _describe(e, timeout)))
    if not failed:  # only the whole batch fails: a batch-size dependent bug
        reason = f"{_describe(batch_error, timeout)} on the batch of {B}, though each completion alone scores fine"
        if on_error == "raise":
            hint = f"; {_how_to_go_on(batch_error)}" if isinstance(batch_error, WorkerFault) and batch_error.died else ""
            raise RewardError(f"reward function {name!r} {reason}{hint}")
        if errors is not None:
            errors.append((name, None, reason))
    return values


def preflight_check(reward_funcs: Sequence[RewardFunc], prompts: list, columns: dict[str, list],
                    max_steps: int = 1, timeout: float | None = None) -> None:
    """Check that each function takes the keyword arguments of the trainer's call, then call it once on
    a tiny batch of placeholder completions, before any model is loaded, so a function with the wrong
    parameters or returning the wrong shape fails in seconds, not after the first rollout. A function
    that raises on the placeholder text is left for the real batch to judge; one that does not answer
    within ``timeout`` (reward_timeout) is stopped, and the run with it."""
    completions = ["" if isinstance(p, str) else [{"role": "assistant", "content": ""}] for p in prompts]
    context = reward_context(TrainerState(global_step=0, max_steps=max_steps, epoch=0.0))
    keywords = ["prompts", "completions", "completion_ids", *columns, *context]
    for func in reward_funcs:
        check_reward_signature(func, keywords, list(columns))
    batch = dict(prompts=prompts, completions=completions, completion_ids=[[] for _ in prompts], **columns)
    for func in reward_funcs:
        name = reward_name(func)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outcome = _call_all([func], batch, timeout, None, without_logging(context))[0]
        if isinstance(outcome, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)):
            raise RewardError(f"reward function {name!r} did not answer within reward_timeout={timeout}s when called "
                              f"on {len(prompts)} placeholder completions before training (the check that it takes "
                              "the trainer's call); the call was stopped. Make it answer faster (a judge it waits "
                              "for, a loop that never ends?), or raise reward_timeout") from outcome
        if not isinstance(outcome, BaseException):  # a raise on the placeholder text is not judged here
            for i, value in enumerate(checked_values(outcome, name, len(prompts))):
                if value is not None:
                    reward_value(value, name, i)
