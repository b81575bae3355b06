"""What a run does between its steps: the metrics of each optimizer step logged (as logging_steps or
a callback says), the held-out evaluation when due, completions recorded, checkpoints written when
due or when a signal asks the run to stop. Each function takes the run (``Assembled``) and its state
(``RunState``), and those that change the state return the next one."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
from typing import Callable, Iterator

from covey import core
from covey.errors import NumericsError, TrainingInterrupted
from covey.telemetry.runlog import RunLog
from covey.telemetry.tables import percent
from covey.train.assemble import Assembled
from covey.train.batch import ScoredBatch, StepResult
from covey.train.callbacks import Callbacks
from covey.train.metrics import interval_mean, step_metrics
from covey.train.run_checkpoints import checkpoint_every_process
from covey.train.run_state import RunState


def crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in (before, after]."""
    return after // every > before // every


def evaluate_if_due(run: Assembled, state: RunState, callbacks: Callbacks, log: RunLog, steps_before: int,
                    held_out: Callable[[], dict]) -> dict[str, float]:
    """The held-out evaluation (``held_out``) under eval_strategy: steps when the step crossed a multiple of
    eval_steps, or when a callback asks for one (before the last step: the evaluation after training comes
    then), as ``eval/...`` metrics; else none."""
    args, step = run.args, state.global_step
    due = args.eval_strategy == "steps" and crossed(steps_before, step, args.eval_steps or args.logging_steps)
    asked = callbacks.take("should_evaluate")  # by a callback
    if step >= args.max_steps or callbacks.stopping or not (due or asked):
        return {}  # the evaluation after training comes next
    if not run.eval_rows:
        log.info(f"[yellow]step {step}: a callback asked for an evaluation (control.should_evaluate), and this "
                 "run has no held-out data (eval_dataset): none is made[/]")
        return {}
    result = held_out()
    mean = "n/a" if result["mean_reward"] is None else f"{result['mean_reward']:.3f}"
    log.info(f"step {step}: held-out accuracy {percent(result['accuracy'])} (mean reward {mean}, n={result['n']})")
    return {**{f"eval/{key}": math.nan if result[key] is None else result[key] for key in ("accuracy", "mean_reward")},
            "eval/checked": result["checked"]}  # the problems checked, for the binomial error of the accuracy


def log_step(run: Assembled, state: RunState, callbacks: Callbacks, log: RunLog, result: StepResult,
             evaluation: dict[str, float]) -> tuple[RunState, ScoredBatch | None]:
    """The metrics of each of the step's optimizer steps, over the batch of every process (gathered on
    the first, which returns it; None on the others), logged as logging_steps or a callback says;
    ``evaluation`` (held-out metrics after the step) joins the last, which is then logged whatever
    logging_steps says, as is the last before a callback's stop. A step that ended on too many skipped
    optimizer steps in a row stops the run, once its metrics are written. The state after it."""
    args, rewards = run.args, run.parts.rewards
    merged = merged_on_main(run, result)
    for update in result.updates:
        last = update is result.updates[-1]
        if merged is not None:
            whole, reward_metrics, dynamic_sampling = merged
            metrics = {**step_metrics(whole, update, rewards.names, rewards.weights_F, reward_metrics, dynamic_sampling,
                                      result.progress.reward_errors, core.reported_metrics(run.parts.loss_settings)),
                       **(evaluation if last else {})}
            state = dataclasses.replace(state, unlogged=(*state.unlogged, metrics))
        asked = callbacks.take("should_log", update.global_step)
        if (update.global_step % args.logging_steps == 0 or update.global_step == args.max_steps or asked
                or (args.logging_first_step and update.global_step == 1)
                or (last and (evaluation or callbacks.stopping))):
            state = write_metrics(state, callbacks, log, update.global_step)
    if (bad := result.progress.consecutive_bad_steps) >= args.max_consecutive_bad_steps:
        if state.unlogged:  # the steps up to the failing one, whatever logging_steps says
            write_metrics(state, callbacks, log, result.progress.global_step)
        raise NumericsError(f"{bad} steps in a row had NaN/inf gradients (step {result.progress.global_step}); "
                            "lower the learning rate, check the rewards for NaN/inf, or try bf16: false")
    return dataclasses.replace(state, history=tuple(log.history)), None if merged is None else merged[0]


def write_metrics(state: RunState, callbacks: Callbacks, log: RunLog, step: int) -> RunState:
    """Log the mean of the metrics since the last logged step, as of ``step``, and tell the callbacks; the
    state with none left unlogged."""
    metrics = interval_mean(list(state.unlogged))
    log.log_metrics(step, metrics)
    callbacks.log_training(step, metrics)
    return dataclasses.replace(state, unlogged=())


def merged_on_main(run: Assembled, result: StepResult) -> tuple[ScoredBatch, dict, dict] | None:
    """The step's batch of every process in rank order, what their reward functions logged and their
    dynamic-sampling counts, on the first process (None on the others)."""
    parts = run.world.gather_on_main((result.batch, result.reward_metrics, result.dynamic_sampling))
    if parts is None:
        return None
    reward_metrics: dict[str, list[float]] = {}
    for _, logged, _ in parts:
        for name, values in logged.items():
            reward_metrics.setdefault(name, []).extend(values)
    dynamic_sampling = {  # every process runs the same number of extra rounds
        key: (max if key == "dynamic_sampling/extra_rounds" else sum)(counts[key] for _, _, counts in parts)
        for key in result.dynamic_sampling}
    return (ScoredBatch.concat([batch for batch, _, _ in parts], run.parts.sampler.tokenizer.pad_token_id), reward_metrics,
            dynamic_sampling)


def after_step(run: Assembled, state: RunState, callbacks: Callbacks, log: RunLog, stop: StopRequest,
               steps_before: int, passes_before: int, records: list[dict]) -> None:
    """After a step's optimizer steps (``steps_before`` were taken before it, ``passes_before`` passes
    over the prompts drawn): record its completions when due, then checkpoint as save_strategy says,
    when a callback asks, or when asked to stop (``stop``). Checkpoints fall between steps, where the
    state is small and complete."""
    args, step, hub = run.args, state.global_step, run.hub
    passes = run.prompt_sampler.passes_in(state.progress.rounds_sampled)
    if args.log_completions and (steps_before == 0 or step == args.max_steps or callbacks.stopping
                                 or crossed(steps_before, step, args.log_completions_steps)):
        log.log_completions(step, records, args.num_completions_to_print)
    # a signal to any process stops them all; one in the last step: just finish
    stop_signal = next((s for s in run.world.gather(stop.signal) if s is not None), None)
    stopping = stop_signal is not None and step < args.max_steps
    if args.save_strategy == "steps":
        due = args.save_steps > 0 and crossed(steps_before, step, args.save_steps)
    else:
        due = args.save_strategy == "epoch" and passes > passes_before
    if not (callbacks.take("should_save") or due or stopping):
        return
    path = checkpoint_every_process(run, state)
    log.info(f"checkpoint saved: {path}")
    callbacks.call("on_save", step)
    if hub is not None:
        callbacks.call("on_push_begin", step)
        progress = f"epoch {passes}" if args.save_strategy == "epoch" else f"step {step}"
        for line in hub.push_checkpoint(path, f"Training in progress, {progress}"):
            log.info(line)
    if stopping:
        raise TrainingInterrupted(
            f"stopped by {signal.Signals(stop_signal).name} at step {step}; checkpoint saved in {path}. "
            f"Continue with: covey train CONFIG --output-dir {run.run_dir} --resume-from-checkpoint auto",
            stop_signal)


class StopRequest:
    """A stop asked for by SIGINT or SIGTERM: the signal's number, set by the handler, read between steps."""

    def __init__(self) -> None:
        self.signal: int | None = None


@contextlib.contextmanager
def stop_on_signals(log: RunLog, processes: int) -> Iterator[StopRequest]:
    """SIGINT / SIGTERM: finish the current step, save a checkpoint, stop. A second one stops at once."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def request_stop(signum, frame):
        if stop.signal is not None:
            raise KeyboardInterrupt
        stop.signal = signum
        log.say_from_signal_handler(f"{signal.Signals(signum).name} received: saving a checkpoint after this step "
                                    "(send it again to stop at once, without saving)")
        if processes > 1:
            log.say_from_signal_handler("a signal sent to torchrun reaches the processes, but torchrun kills them "
                                        "30 s later unless started with a longer --shutdown-timeout")

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
