"""The reward-function convention (TRL's): how a reward function is called and named, what it is told
of training, and the checks that a function and a dataset fit it before anything runs.

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

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from covey.data.rows import TRAINER_REWARD_ARGS
from covey.errors import DataError, RewardError

RewardFunc = Callable[..., list]


def reward_name(func: RewardFunc) -> str:
    """The name a reward function's metrics and recorded rewards go under: its ``__name__``, a
    ``functools.partial``'s function's, else its class's."""
    if not hasattr(func, "__name__") and isinstance(func, functools.partial):
        return reward_name(func.func)
    return getattr(func, "__name__", type(func).__name__)


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


def without_logging(context: dict[str, Any], stand_in: Callable = _not_logged) -> dict[str, Any]:
    """``context`` with ``stand_in`` for log_metric and log_extra: for calls whose logs must not
    reach the trainer (one completion retried alone is not the batch)."""
    return {**context, "log_metric": stand_in, "log_extra": stand_in} if context else context


def required_columns(func: RewardFunc) -> set[str]:
    """The dataset columns ``func`` needs: its parameters without a default, other than the trainer's."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: nothing to inspect
        return set()
    return {p.name for p in parameters if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - TRAINER_REWARD_ARGS


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


def check_reward_columns(rows: list[dict], reward_funcs: list, source: str, others_may_come: bool = False) -> None:
    """Every column a reward function requires by name exists and has a value in every row
    (``others_may_come``: a column the data lacks may come from elsewhere, a rollout_func's output)."""
    for func in reward_funcs:
        for column in sorted(required_columns(func)):
            if column not in rows[0] and others_may_come:
                continue
            if column not in rows[0]:
                raise DataError(f"{source}: reward function {reward_name(func)!r} needs a column {column!r}, which "
                                f"the data lacks (columns: {', '.join(rows[0])}); add it or give the parameter a default")
            empty = next((i for i, row in enumerate(rows) if row[column] is None), None)
            if empty is not None:
                raise DataError(f"{source}, row {empty}: column {column!r}, needed by reward function "
                                f"{reward_name(func)!r}, is empty; fill it in or drop the row")
