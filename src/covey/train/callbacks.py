"""transformers' ``TrainerCallback`` objects in a covey run.

``GRPOTrainer(callbacks=[...])`` takes what transformers' Trainer takes (callback objects, or classes,
made with no arguments) and calls them at the same points of the run, with transformers' own
``TrainerState`` and ``TrainerControl``:

    on_init_end      the trainer is built
    on_train_begin   train() starts, before the evaluation before training
    on_step_begin    before each optimizer step (the first of a generation round: before it samples)
    on_step_end      after each optimizer step, ``state.global_step`` counting it
    on_log           each logged step, with what metrics.jsonl gets (TRL's names) and ``epoch``
    on_evaluate      each held-out evaluation: eval_accuracy, eval_mean_reward, eval_n
    on_save          after each checkpoint is written
    on_push_begin    before each push to the Hub (first process only)
    on_train_end     after the final model, the last evaluation and summary.json

The other events of transformers' loop (on_epoch_*, on_substep_end, on_pre_optimizer_step,
on_optimizer_step, on_predict, on_prediction_step) are never called. What ``control`` asks, whenever
it is set, is done at the next point covey can do it: should_training_stop ends the run after the
optimizer step (final model and summary as at any end), should_log logs the step whatever
logging_steps says, should_evaluate and should_save evaluate and checkpoint once the generation
round is over (checkpoints fall between rounds). Under several processes every process calls its
callbacks, and what any one's callbacks ask, all do.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from covey.config import GRPOConfig  # its TRL settings read back as given (GRPOConfig.__getattr__)
from covey.data import PromptSampler
from covey.errors import ConfigError
from covey.train.batch import Update
from covey.train.distributed import World

# what control can ask for besides a stop, and the event that does it (which clears the request)
REQUESTS = {"should_log": "on_log", "should_evaluate": "on_evaluate", "should_save": "on_save"}


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


class CallbackArgs:
    """What callbacks get as ``args``: the run's GRPOConfig (TRL's field names), ``output_dir`` the run
    folder, and the TrainingArguments names a callback reads for what covey does itself. A name
    neither has is an AttributeError that says so; callbacks cannot change the run's settings."""

    def __init__(self, config: GRPOConfig, run_dir: Path, world: World):
        local = _local_rank()
        own = {
            "output_dir": str(run_dir),
            "process_index": world.rank, "world_size": world.size, "local_process_index": local,
            "local_rank": local if world.size > 1 else -1,  # transformers' value for a single process
            "should_log": world.is_main, "should_save": world.is_main,  # the first process writes the run
            "train_batch_size": config.per_device_train_batch_size,
            # covey keeps no best model, evaluates from the first step and restores no callback state
            "load_best_model_at_end": False, "metric_for_best_model": None, "greater_is_better": None,
            "eval_delay": 0, "restore_callback_states_from_checkpoint": False,
        }
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_own", own)

    def __getattr__(self, name: str) -> Any:
        own = object.__getattribute__(self, "_own")
        if name in own:
            return own[name]
        try:
            return getattr(object.__getattribute__(self, "_config"), name)
        except AttributeError:
            raise AttributeError(f"a callback read args.{name}, which covey's GRPOConfig does not have (its fields "
                                 "are TRL's names; `covey train --help` lists them)") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a callback set args.{name}: a run's settings are fixed once it is built (set "
                             "them in its GRPOConfig)")

    def to_dict(self) -> dict[str, Any]:
        """The settings as a dict, a token as a placeholder (as transformers writes it)."""
        values = {**dataclasses.asdict(self._config), **self._own}
        return {k: f"<{k.upper()}>" if k.endswith("_token") and v is not None else v for k, v in values.items()}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """to_dict with every value a bool, number or text (what TensorBoard's hparams take)."""
        return {k: v if type(v) in (bool, int, float, str) else str(v) for k, v in self.to_dict().items()}


def check_callbacks(callbacks: Iterable[Any]) -> None:
    """Each is a callback object or class: it has at least one of the events."""
    for callback in callbacks:
        if not any(callable(getattr(callback, name, None)) for name in EVENTS):
            raise ConfigError(f"callbacks: {callback!r} has none of a callback's methods ({', '.join(EVENTS[:4])}, ...); "
                              "give transformers.TrainerCallback objects or subclasses")


class Callbacks:
    """The run's callbacks and the state and control they share. ``sampler``: the run's, whose passes
    over the training prompts are the epochs; ``epoch()``: the passes trained on so far (under
    async_generation the sampler is rounds ahead); ``objects``: what every event is handed besides (model,
    processing_class, optimizer, lr_scheduler). transformers is imported only once there is a callback
    or ``state`` is read, so that a run without callbacks does not pay for it."""

    def __init__(self, callbacks: Iterable[Any], args: CallbackArgs, world: World, sampler: PromptSampler,
                 epoch: Callable[[], float], trained: Callable[[], list[dict]], **objects: Any):
        self.callbacks: list[Any] = []
        self.args, self.world, self.sampler, self.epoch, self.objects = args, world, sampler, epoch, objects
        self.trained = trained  # the trainer's history of logged training steps (restored on resume)
        self.global_step = 0
        self._log_history: list[dict] | None = None  # made from ``trained`` when first read
        self._step_epochs: dict[int, float] = {}  # until then: the epoch of each training step logged
        self._state = self._control = None
        self.stopping = False  # a callback asked the training to stop
        self.asked: dict[str, set[int]] = {request: set() for request in REQUESTS}  # steps of the requests not done yet
        for callback in callbacks:
            self.add(callback)

    # ---- the list, as transformers' Trainer exposes it ---------------------------------------

    def add(self, callback: Any) -> None:
        check_callbacks([callback])
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop(self, callback: Any) -> Any:
        """Remove a callback (an object, or the first of a class) and return it; None where there is none."""
        for instance in self.callbacks:
            if (isinstance(instance, callback) if isinstance(callback, type) else instance is callback):
                self.callbacks.remove(instance)
                return instance
        return None

    def remove(self, callback: Any) -> None:
        if self.pop(callback) is None and not isinstance(callback, type):  # as transformers: a missing object is an error
            raise ValueError(f"{callback!r} is not one of the trainer's callbacks")

    # ---- state and control --------------------------------------------------------------------

    @property
    def log_history(self) -> list[dict]:
        """transformers' log_history. A run that nothing reads it from (no callback, no ``state`` asked
        for) does not hold each logged step's metrics a second time: the trainer's history has them, and
        the list is made from it when first read."""
        if self._log_history is None:
            self._log_history = [
                {**{k: v for k, v in entry.items() if k != "step" and not k.startswith("health/")},
                 **({"epoch": self._step_epochs[entry["step"]]} if entry["step"] in self._step_epochs else {}),
                 "step": entry["step"]} for entry in self.trained()]
            self._step_epochs.clear()
        return self._log_history

    @property
    def state(self):
        """transformers' TrainerState of the run, as of the last event."""
        if self._state is None:
            from transformers import TrainerState

            args, local = self.args, _local_rank()
            self._state = TrainerState(
                max_steps=args.max_steps, logging_steps=args.logging_steps,
                eval_steps=args.eval_steps or args.logging_steps, save_steps=args.save_steps,
                train_batch_size=args.per_device_train_batch_size, num_train_epochs=self._epochs(),
                log_history=self.log_history, is_world_process_zero=self.world.is_main,
                is_local_process_zero=local == 0)
        self._state.global_step, self._state.epoch = self.global_step, self.epoch()
        return self._state

    def _epochs(self) -> int:
        """The passes over the training prompts that max_steps make, rounded up."""
        return self.sampler.passes_begun_in(math.ceil(self.args.max_steps / self.args.optimizer_steps_per_generation))

    @property
    def control(self):
        """transformers' TrainerControl the callbacks set."""
        if self._control is None:
            from transformers import TrainerControl

            self._control = TrainerControl()
        return self._control

    def call(self, event: str, global_step: int, **kwargs: Any) -> None:
        """Call ``event`` on every callback, in order, at ``global_step``; a callback that returns a
        TrainerControl replaces the control (as in transformers)."""
        self.global_step = global_step
        if not self.callbacks:
            return
        if event == "on_train_begin":
            self.control.should_training_stop = False
        for request, done_by in REQUESTS.items():
            if done_by == event:
                setattr(self.control, request, False)
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if method is None:
                continue
            result = method(self.args, self.state, self.control, train_dataloader=None, eval_dataloader=None,
                            **self.objects, **kwargs)
            if result is not None:
                self._control = result

    def _gather_requests(self, global_step: int) -> None:
        """Move what control asks now into ``asked`` (as of ``global_step``), agreed by every process."""
        control = self._control
        flags = [bool(control and getattr(control, name)) for name in ("should_training_stop", *REQUESTS)]
        if self.world.size > 1:
            flags = [any(column) for column in zip(*self.world.gather(flags))]
        self.stopping = self.stopping or flags[0]
        for request, asked in zip(REQUESTS, flags[1:]):
            if asked:
                self.asked[request].add(global_step)
                setattr(self.control, request, False)

    def take(self, request: str, global_step: int | None = None) -> bool:
        """Whether the callbacks asked ``request`` (by ``global_step``, or at any step so far), which is
        then taken as done; every process must ask at the same points."""
        self._gather_requests(self.global_step if global_step is None else global_step)
        steps = self.asked[request]
        due = {s for s in steps if global_step is None or s <= global_step}
        steps -= due
        return bool(due)

    def stop_asked(self) -> bool:
        """Whether a callback asked the training to stop (in any process)."""
        self._gather_requests(self.global_step)
        return self.stopping

    # ---- the events at covey's points ---------------------------------------------------------

    def step_begin(self, global_step: int) -> None:
        self._gather_requests(global_step)  # what was asked since the last step stays asked
        self.call("on_step_begin", global_step)

    def step_end(self, update: Update) -> bool:
        self.call("on_step_end", update.global_step)
        self._gather_requests(update.global_step)
        return self.stopping

    def log(self, global_step: int, metrics: dict[str, float], from_main: bool = True) -> None:
        """on_log with ``metrics``, entered in log_history: the first process's (the others compute none;
        every process calls this then), or with ``from_main`` False this process's own."""
        logs = {**(self.world.on_main(lambda: metrics) if from_main else metrics), "epoch": self.epoch()}
        self.log_history.append({**logs, "step": global_step})
        self.call("on_log", global_step, logs=logs)

    def log_training(self, global_step: int, metrics: dict[str, float]) -> None:
        """``log`` for a training step's metrics, which the trainer's history holds too: on the first
        process, while nothing has read log_history, only the step's epoch is kept (log_history is made
        from that history when read)."""
        logs = {**self.world.on_main(lambda: metrics), "epoch": self.epoch()}  # every process takes part
        if self._log_history is None and self.world.is_main:
            self._step_epochs[global_step] = logs["epoch"]
        else:
            self.log_history.append({**logs, "step": global_step})
        self.call("on_log", global_step, logs=logs)

    def evaluate(self, global_step: int, result: dict) -> None:
        """on_evaluate with a held-out evaluation's result, under transformers' eval_ names."""
        self.call("on_evaluate", global_step,
                  metrics={f"eval_{key}": result[key] for key in ("accuracy", "mean_reward", "n")})


# every event transformers' TrainerCallback has (covey calls those the module docstring lists)
EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end", "on_step_end", "on_evaluate", "on_predict",
          "on_save", "on_log", "on_prediction_step", "on_push_begin")
