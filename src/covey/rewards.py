"""Reward functions: the TRL calling convention, the built-ins, and loading the user's own.

A reward function is called once per batch as

    fn(prompts=[...], completions=[...], completion_ids=[...], **dataset_columns) -> list[float | None]

where ``completions`` are strings for plain-text prompts and ``[{"role": "assistant", "content": ...}]``
for chat prompts, and every extra dataset column (``answer``, ...) arrives as a list keyword
argument aligned with the completions. ``None`` means "not applicable to this sample". As in TRL,
every call also gets ``trainer_state`` (``.global_step``, ``.max_steps``, ``.epoch``),
``log_metric(name, value)`` (a number logged with the step's metrics) and ``log_extra(column,
values)`` (one value per completion, recorded with the completions).
"""

from __future__ import annotations

import asyncio
import collections.abc
import concurrent.futures
import functools
import importlib
import importlib.util
import inspect
import itertools
import json
import math
import re
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from covey.answers import NUMBER, completion_text, last_number, parse_number, reference_number, same_number, tagged_answer
from covey.config import in_memory, why_unloadable
from covey.errors import RewardError
from covey.reward_pool import RewardPool, WorkerFault
from covey.text import THINK_CLOSE, THINK_OPEN, answer_after_reasoning

RewardFunc = Callable[..., list]

# ---- built-in rewards ---------------------------------------------------------------------------


def answer_format(completions: list, **_: Any) -> list[float]:
    """Partial credit for '<answer>N</answer>': a quarter each for the opening tag, the closing tag,
    a bare number inside the last block (a sign, a leading $ and thousands commas, but no other
    markup or unit: the format asked for), and nothing written after the closing tag."""
    scores = []
    for completion in completions:
        text = completion_text(completion)
        score = 0.25 * ("<answer>" in text) + 0.25 * ("</answer>" in text)
        inside = tagged_answer(text)
        if inside is not None:
            score += 0.25 * (NUMBER.fullmatch(inside.strip().rstrip(".")) is not None)
            score += 0.25 * (text.rstrip().endswith("</answer>"))
        scores.append(score)
    return scores


def answer_correct(completions: list, answer: list, **_: Any) -> list[float | None]:
    """1 if the (last) tagged answer equals the `answer` column (a number, or a GSM8K solution ending
    '#### N'); 0.5 if there is no tagged answer but the last number in the text is right; 0 otherwise.
    None where the row has no usable answer."""
    scores: list[float | None] = []
    for completion, expected in zip(completions, answer):
        target = reference_number(expected)
        if target is None:
            scores.append(None)
            continue
        text = completion_text(completion)
        inside = tagged_answer(text)
        if inside is not None:
            scores.append(1.0 if same_number(parse_number(inside), target) else 0.0)
        else:
            scores.append(0.5 if same_number(last_number(text), target) else 0.0)
    return scores


def reasoning_format(completions: list, **_: Any) -> list[float]:
    """Partial credit for '<think>reasoning</think> answer': a quarter each for the opening tag, the
    closing tag, reasoning inside the block, and an answer after it. (Where the chat template opens the
    block in the prompt, every completion misses the first quarter alike: the advantages are the same.)"""
    scores = []
    for completion in completions:
        text = completion_text(completion)
        opened, closed = THINK_OPEN in text, THINK_CLOSE in text
        inside = text.split(THINK_OPEN, 1)[1] if opened else text
        inside = inside.split(THINK_CLOSE, 1)[0] if closed else ""
        after = answer_after_reasoning(text) if closed else ""
        scores.append(0.25 * opened + 0.25 * closed + 0.25 * bool(inside.strip()) + 0.25 * bool(after))
    return scores


def json_format(completions: list, **_: Any) -> list[float]:
    """1 if the answer (what follows any reasoning block) is a JSON object or array and nothing else;
    0.5 if one can be read from it (in a code fence, or starting at one of its first 16 '{' or '['); 0
    otherwise."""
    scores = []
    for completion in completions:
        answer = answer_after_reasoning(completion_text(completion)).strip()
        if isinstance(_json_value(answer), (dict, list)):
            scores.append(1.0)
            continue
        fenced = (_json_value(m.group(1)) for m in _CODE_FENCE.finditer(answer))
        opened = (_json_value(answer[m.start():], prefix=True)
                  for m in itertools.islice(_JSON_OPENING.finditer(answer), 16))
        scores.append(0.5 if any(isinstance(v, (dict, list)) for v in (*fenced, *opened)) else 0.0)
    return scores


_CODE_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
_JSON_OPENING = re.compile(r"[{\[]")


def _json_value(text: str, prefix: bool = False) -> Any:
    """``text`` read as JSON (with ``prefix``, the value it starts with, what follows ignored), or None:
    not JSON, or nested too deep to read."""
    try:
        return json.JSONDecoder().raw_decode(text)[0] if prefix else json.loads(text)
    except (ValueError, RecursionError):
        return None


class SoftOverlongPenalty:
    """DAPO's soft overlong punishment (eq. 13): 0 up to max_length - cache_length tokens, then a
    linear ramp down to -1 at max_length, and -1 beyond. Penalises length without rewarding brevity."""

    __name__ = "soft_overlong_penalty"

    def __init__(self, max_length: int, cache_length: int):
        if not 0 < cache_length <= max_length:
            raise RewardError(f"soft_overlong_penalty: need 0 < cache_length ({cache_length}) <= max_length ({max_length})")
        self.max_length, self.cache_length = max_length, cache_length

    def __call__(self, completion_ids: list[list[int]], **_: Any) -> list[float]:
        free = self.max_length - self.cache_length
        return [0.0 if len(ids) <= free else -1.0 if len(ids) > self.max_length else (free - len(ids)) / self.cache_length
                for ids in completion_ids]


BUILTIN_REWARDS: dict[str, RewardFunc] = {"answer_format": answer_format, "answer_correct": answer_correct,
                                           "reasoning_format": reasoning_format, "json_format": json_format}


def code_tests(**settings: Any) -> RewardFunc:
    """The sandboxed code-execution reward (``covey.code_reward``; Linux only, so imported on use)."""
    from covey.code_reward import CodeTests

    return CodeTests(**settings)


# Built-ins that take settings (from the config fields named in their help).
BUILTIN_REWARD_FACTORIES: dict[str, Callable[..., RewardFunc]] = {"soft_overlong_penalty": SoftOverlongPenalty,
                                                                "code_tests": code_tests}


# ---- loading ------------------------------------------------------------------------------------


def load_reward_func(spec: str | RewardFunc, builtin_settings: dict[str, dict] | None = None) -> RewardFunc:
    """A built-in name, 'path/to/file.py:function', 'package.module:function', or a callable.
    ``builtin_settings`` holds the keyword arguments of built-ins that take settings."""
    if callable(spec):
        return spec
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if spec in BUILTIN_REWARD_FACTORIES:
        return BUILTIN_REWARD_FACTORIES[spec](**(builtin_settings or {}).get(spec, {}))
    if reason := why_unloadable(spec, "reward_funcs"):
        raise RewardError(reason)
    if ":" not in spec:
        names = ", ".join([*BUILTIN_REWARDS, *BUILTIN_REWARD_FACTORIES])
        raise RewardError(f"reward function {spec!r} is not a built-in ({names}) and not a "
                          "reference; write 'path/to/rewards.py:function' or 'package.module:function'")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        module = _module_from_file(spec, Path(where))
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise RewardError(f"reward function {spec!r}: cannot import module {where!r} ({e})") from e
        except Exception as e:  # the module's own code failed: any exception
            raise RewardError(f"reward function {spec!r}: importing module {where!r} raised {type(e).__name__}: {e}; "
                              "fix the module") from e
    func = getattr(module, name, None)
    if not callable(func):
        raise RewardError(f"reward function {spec!r}: {where} has no function named {name!r}")
    return func


def _module_from_file(spec: str, path: Path) -> Any:
    """The module of ``path``, run with its folder first on sys.path (so that it can import the files
    beside it, as a script can); the folder then moves to the end of sys.path, where a function that
    imports a file beside it when called still finds it, and no installed package is shadowed."""
    if not path.is_file():
        raise RewardError(f"reward function {spec!r}: file {path} does not exist")
    folder = str(path.resolve().parent)
    module_name = f"covey_user_rewards_{abs(hash(str(path.resolve())))}"
    sys.path.insert(0, folder)
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: a syntax error, a missing dependency, any raise
        sys.modules.pop(module_name, None)
        fix = "install the package it imports, or fix the import" if isinstance(e, ImportError) else "fix the file"
        raise RewardError(f"reward function {spec!r}: loading {path} raised {type(e).__name__}: {e}; {fix}") from e
    finally:
        sys.path.remove(folder)
        if folder not in sys.path:
            sys.path.append(folder)
    return module


def reward_name(func: RewardFunc) -> str:
    """The name a reward function's metrics and recorded rewards go under: its ``__name__``, a
    ``functools.partial``'s function's, else its class's."""
    if not hasattr(func, "__name__") and isinstance(func, functools.partial):
        return reward_name(func.func)
    return getattr(func, "__name__", type(func).__name__)


def reward_reference(spec: str | RewardFunc) -> str:
    """How ``load_reward_func`` finds this reward again: its name or reference as given, a built-in's
    name, 'package.module:function' for a function of an importable module; else a marker that
    names it and loads nothing (a function defined in a script or notebook)."""
    if isinstance(spec, str):
        return spec
    builtin = next((name for name, func in BUILTIN_REWARDS.items() if func is spec), None)
    module, qualname = getattr(spec, "__module__", None), getattr(spec, "__qualname__", "")
    if builtin is None and module and module != "__main__" and "<" not in qualname:
        try:
            found = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
        if found is spec:
            return f"{module}:{qualname}"
    return builtin or in_memory(f"function {reward_name(spec)}")


# what every reward function receives from the trainer; its other parameters name dataset columns
TRAINER_REWARD_ARGS = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra"})


@dataclass(frozen=True)
class TrainerState:
    """What a reward function is told of training (TRL's ``trainer_state``)."""

    global_step: int  # optimizer steps taken so far
    max_steps: int
    epoch: float  # passes over the training data done, a fraction within the current one (0.0 at the start)


def _not_logged(*_: Any) -> None:
    """``log_metric`` / ``log_extra`` where nothing collects them (a module-level function, so that
    it reaches reward worker processes)."""


def reward_context(state: TrainerState, log_metric: Callable | None = None,
                   log_extra: Callable | None = None) -> dict[str, Any]:
    """The keyword arguments every reward call gets beside the batch (TRL's): ``trainer_state``,
    ``log_metric(name, value)`` and ``log_extra(column, values)``, which do nothing unless given."""
    return {"trainer_state": state, "log_metric": log_metric or _not_logged, "log_extra": log_extra or _not_logged}


def _logged_in_a_worker(*_: Any) -> None:
    """``log_metric`` / ``log_extra`` in a reward worker process, which cannot reach the trainer."""
    warnings.warn("a reward function called log_metric or log_extra in a reward worker process, which cannot pass "
                  "them to the trainer: not logged. Set reward_num_workers: 0 to log them", stacklevel=2)


def without_logging(context: dict[str, Any], stand_in: Callable = _not_logged) -> dict[str, Any]:
    """``context`` with ``stand_in`` for log_metric and log_extra: for calls whose logs must not
    reach the trainer (one completion retried alone is not the batch)."""
    return {**context, "log_metric": stand_in, "log_extra": stand_in} if context else context


def _context_for(func: RewardFunc, context: dict[str, Any], pool: RewardPool | None) -> dict[str, Any]:
    """``context`` as ``func`` gets it: in a worker process the loggers cannot reach the trainer."""
    return without_logging(context, _logged_in_a_worker) if pool is not None and pool.runs(func) else context


def required_columns(func: RewardFunc) -> set[str]:
    """The dataset columns ``func`` needs: its parameters without a default, other than the trainer's."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: nothing to inspect
        return set()
    return {p.name for p in parameters if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - TRAINER_REWARD_ARGS


def call_reward(func: RewardFunc, kwargs: dict, timeout: float | None) -> Any:
    """One call, within ``timeout`` seconds when set. A call past it is left running in a daemon
    thread (a thread cannot be killed; a worker process's call is, see reward_pool), which never
    holds up the interpreter's exit."""
    if inspect.iscoroutinefunction(func):
        return run_coroutine(asyncio.wait_for(func(**kwargs), timeout))
    if timeout is None:
        return func(**kwargs)
    outcome: list = []

    def call() -> None:
        try:
            outcome.append((True, func(**kwargs)))
        except BaseException as e:  # handed to the caller as it is
            outcome.append((False, e))

    thread = threading.Thread(target=call, name=f"reward-{reward_name(func)}", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        raise TimeoutError(f"reward call took longer than {timeout}s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


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
        values = returned_values(values)
        if not isinstance(values, (list, tuple)) or len(values) != B:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise RewardError(f"reward function {name!r} returned {got} for {B} completions; it must return one "
                              "float (or None) per completion, as a list, tuple, numpy array or tensor")
        for i, value in enumerate(values):
            if value is not None:
                table[i, j] = reward_value(value, name, i)
    return table


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
                                  "fix the function, or set reward_errors: skip to score such samples as None") from e
            failed = True
            values.append(None)
            if errors is not None:
                errors.append((name, i, _describe(e, timeout)))
    if not failed:  # only the whole batch fails: a batch-size dependent bug
        reason = f"{_describe(batch_error, timeout)} on the batch of {B}, though each completion alone scores fine"
        if on_error == "raise":
            raise RewardError(f"reward function {name!r} {reason}")
        if errors is not None:
            errors.append((name, None, reason))
    return values


def check_reward_signature(func: RewardFunc, keywords: Sequence[str], columns: Sequence[str] = ()) -> None:
    """Raise a RewardError if ``func`` cannot be called with exactly these keyword arguments (those of the
    trainer's call; ``columns``: the dataset's among them). A signature that cannot be inspected (a
    builtin, some C callables) is left for the call to judge, and a decorated function is judged by its
    wrapper's signature, which may well take what the function it wraps does not."""
    try:
        signature = inspect.signature(func, follow_wrapped=False)
    except (TypeError, ValueError):
        return
    keywords = list(dict.fromkeys(keywords))
    try:
        signature.bind(**dict.fromkeys(keywords))
        return
    except TypeError as e:
        problems = _signature_problems(signature, keywords, reward_name(func), columns) or [str(e)]
    raise RewardError(f"reward function {reward_name(func)!r} cannot take the trainer's call: {'; '.join(problems)}. "
                      "Each call passes by keyword prompts, completions, completion_ids, trainer_state, log_metric, "
                      f"log_extra and every dataset column ({', '.join(columns) or 'none'})")


def _signature_problems(signature: inspect.Signature, keywords: list[str], name: str, columns: Sequence[str]) -> list:
    """Why a function of this signature cannot be called with these keywords, and how to fix it."""
    parameters = signature.parameters.values()
    by_keyword = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unaccepted = [] if any(p.kind is p.VAR_KEYWORD for p in parameters) else [k for k in keywords if k not in by_keyword]
    required = [p for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    missing = [p.name for p in required if p.kind is not p.POSITIONAL_ONLY and p.name not in keywords]
    positional = [p.name for p in required if p.kind is p.POSITIONAL_ONLY]
    problems = []
    if unaccepted:
        rest = "kwargs" if "kwargs" not in signature.parameters else "more_kwargs"
        example = signature.replace(parameters=[p.replace(annotation=p.empty) for p in parameters]
                                    + [inspect.Parameter(rest, inspect.Parameter.VAR_KEYWORD)],
                                    return_annotation=inspect.Signature.empty)
        problems.append(f"it does not accept the keyword argument(s) {', '.join(map(repr, unaccepted))}; "
                        f"add **kwargs to its parameters, as in TRL's convention: def {name}{example}")
    if missing:
        problems.append(f"it requires {', '.join(map(repr, missing))}, which is neither a dataset column (the data "
                        f"has: {', '.join(columns) or 'none'}) nor passed by the trainer; add the column or give the "
                        "parameter a default")
    if positional:
        problems.append(f"it takes {', '.join(map(repr, positional))} by position only, but every argument is passed "
                        "by keyword; drop the '/' from its parameters")
    return problems


def preflight_check(reward_funcs: Sequence[RewardFunc], prompts: list, columns: dict[str, list],
                    max_steps: int = 1) -> None:
    """Check that each function takes the keyword arguments of the trainer's call, then call it once on
    a tiny batch of placeholder completions, before any model is loaded, so a function with the wrong
    parameters or returning the wrong shape fails in seconds, not after the first rollout. A function
    that raises on the placeholder text is left for the real batch to judge."""
    completions = ["" if isinstance(p, str) else [{"role": "assistant", "content": ""}] for p in prompts]
    context = reward_context(TrainerState(global_step=0, max_steps=max_steps, epoch=0.0))
    keywords = ["prompts", "completions", "completion_ids", *columns, *context]
    for func in reward_funcs:
        check_reward_signature(func, keywords, list(columns))
    for func in reward_funcs:  # a raise on the placeholder text is not judged here ("skip")
        score_completions([func], prompts, completions, [[] for _ in prompts], columns, on_error="skip", context=context)
