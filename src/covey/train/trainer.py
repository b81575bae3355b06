"""The GRPO trainer: a run assembled once, then its loop of steps.

Each step is ``covey.train.step.grpo_step``: generate, score, advantages, log-probs, loss,
optimizer step. The trainer assembles the run once (``covey.train.assemble``: the rules checked, then
the parts built: ``self.run``), and owns the run's state between steps (``covey.train.run_state``:
``self.run_state``, replaced here and nowhere else). Between steps it logs, evaluates and checkpoints
(``covey.train.between_steps``, ``covey.train.run_checkpoints``), each taking the state and
returning the next; what the run folder receives at the end is ``covey.train.run_outputs``'s. Under
several processes (``covey.train.distributed``) the first records the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence


from covey.agents import ToolCallFormat
from covey.config import GRPOConfig
from covey.errors import ConfigError
from covey.models import keep_freed_memory, quantization_settings
from covey.rewards import RewardFunc, TrainerState, reward_context
from covey.rewards.stoppable import take_stop_counts
from covey.rollout import RolloutEngine
from covey.telemetry.runlog import RunLog
from covey.telemetry.tables import percent, print_summary
from covey.telemetry.trackers import make_trackers
from covey.train import between_steps, setup
from covey.train.accelerator import ProcessView
from covey.train.assemble import Assembled, assemble
from covey.train.asynchronous import AsyncGeneration, AsyncSchedule
from covey.train.batch import Prompts
from covey.train.between_steps import StopRequest
from covey.train.callbacks import CallbackArgs, Callbacks
from covey.train.distributed import World
from covey.train.evaluation import evaluate, merge_evaluations
from covey.train.run_checkpoints import restore
from covey.train.run_rules import Handed
from covey.train.run_outputs import open_run_dir, save_final_model, write_model, write_summary
from covey.train.run_state import RunState
from covey.train.rounds import generate_and_score
from covey.train.step import grpo_step
from covey.trl_fields import defaults_note
from covey.train.trl_api import TRLSurface, TrainingClock, closing_entry, grpo_loss_on


class GRPOTrainer(TRLSurface):
    """Train ``model`` with GRPO on ``train_dataset`` scored by ``reward_funcs``.

        trainer = GRPOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=[my_reward],
                              args=GRPOConfig(max_steps=50), train_dataset=rows)
        trainer.train()

    ``model``: hub id, folder or loaded model (default: ``args.model``). ``reward_funcs``: callables,
    names, or reward models (a sequence classifier's hub id, folder or object; default:
    ``args.reward_funcs``), with ``reward_processing_classes`` their tokenizers (TRL's: one per
    function, None for those that are not models; default: each model's own). ``train_dataset``:
    rows, a ``datasets.Dataset`` or a dataset spec (default: ``args.dataset``). Episodes of several turns, in TRL's conventions (docs/agents.md):
    ``tools`` (functions, default: ``args.tools``), ``environment_factory`` (a class, default:
    ``args.environment_factory``), or the user's own ``rollout_func(prompts, trainer)``;
    ``tool_call_format`` replaces ``args.tool_call_parser``. ``callbacks``: transformers'
    ``TrainerCallback`` objects or classes (covey.train.callbacks says when each event comes).
    Everything is checked before any model is loaded, pushing to the Hub included.
    """

    def __init__(self, model: Any = None, reward_funcs: Sequence[RewardFunc | str] | RewardFunc | None = None,
                 args: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Sequence[Any] | None = None, optimizers: tuple[Any, Any] = (None, None),
                 quantization_config: Any = None, peft_config: Any = None,
                 tools: Sequence[Callable | str] | None = None,
                 rollout_func: Callable[[list, GRPOTrainer], dict] | None = None,
                 environment_factory: Callable[[], Any] | None = None, *,
                 rollout_engine: RolloutEngine | None = None, tool_call_format: ToolCallFormat | None = None,
                 quiet: bool = False):
        args = run_config(args, quantization_config)
        handed = Handed(model, train_dataset, reward_funcs, processing_class, peft_config, rollout_engine,
                        rollout_func, tools, environment_factory, tool_call_format, callbacks, optimizers,
                        World.launched_size())
        self.run: Assembled = assemble(args, handed, eval_dataset, reward_processing_classes,
                                       None if rollout_func is None else lambda prompts: rollout_func(prompts, self))
        # the run's state between steps: only this class replaces it (covey.train.run_state)
        self.run_state = (RunState.start(self.args) if self.run.resume_from is None
                          else restore(self.run, self.run.resume_from))
        self.summary: dict | None = None  # what train() wrote to summary.json
        self.accelerator = ProcessView(self.world, next(self.parts.policy.model.parameters()).device)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset  # as given (TRL's members)
        self.quiet = quiet or not self.world.is_main
        self.callback_handler = Callbacks(callbacks or [], CallbackArgs(self.args, self.run_dir, self.world), self.world,
                                          self.prompt_sampler, lambda: self.epochs_trained, lambda: self.history,
                                          model=self.model,
                                          processing_class=self.processing_class, optimizer=self.optimizer,
                                          lr_scheduler=self.scheduler)
        self.callback_handler.call("on_init_end", self.global_step)

    # the run, as assembled (covey.train.assemble.Assembled)
    args = property(lambda self: self.run.args, doc="The config the run uses (max_steps resolved from the epochs).")
    parts = property(lambda self: self.run.parts, doc="The step's parts (covey.train.parts.StepParts).")
    world = property(lambda self: self.run.world, doc="The processes of the run (covey.train.distributed.World).")
    prompt_sampler = property(lambda self: self.run.prompt_sampler, doc="The order the training prompts are drawn in.")
    run_dir = property(lambda self: self.run.run_dir, doc="The run folder (claimed by train()).")
    eval_rows = property(lambda self: self.run.eval_rows, doc="The held-out rows (None: none).")
    # where the run stands (covey.train.run_state.RunState)
    progress = property(lambda self: self.run_state.progress, doc="The run's counters (covey.train.batch.Progress).")
    global_step = property(lambda self: self.run_state.global_step, doc="Optimizer steps taken so far.")
    history = property(lambda self: list(self.run_state.history), doc="Each logged step's metrics.")

    # the run's parts, as the step holds them
    reference = property(lambda self: self.parts.policy.reference, doc="The reference model (None when beta == 0).")
    engine = property(lambda self: self.parts.sampler.engine, doc="The rollout engine.")
    tokenizer = property(lambda self: self.parts.sampler.tokenizer)
    # TRL's name, which rollout functions read: a vision-language model's processor, else the tokenizer
    processing_class = property(lambda self: self.parts.sampler.processor or self.parts.sampler.tokenizer)
    optimizer = property(lambda self: self.parts.policy.optimizer)
    scheduler = property(lambda self: self.parts.policy.scheduler)
    # transformers' names for the callbacks' view of the run
    state = property(lambda self: self.callback_handler.state, doc="transformers' TrainerState of the run.")
    control = property(lambda self: self.callback_handler.control, doc="transformers' TrainerControl.")

    def add_callback(self, callback: Any) -> None:
        """Add a transformers TrainerCallback (an object, or a class made with no arguments)."""
        self.callback_handler.add(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove a callback (an object, or the first of a class) and return it (None where there is none)."""
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback (an object, or the first of a class)."""
        self.callback_handler.remove(callback)

    # ---- the loop ---------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **_: Any):
        """Run max_steps optimizer steps. Returns transformers' ``TrainOutput`` (global_step, training_loss,
        metrics), whose metrics also close state.log_history; ``self.summary`` is what summary.json holds.
        ``resume_from_checkpoint`` (TRL's argument) is the config's field of that name."""
        from transformers.trainer_utils import TrainOutput

        args = self.args
        if resume_from_checkpoint not in (None, False) and self.run.resume_from is None:
            raise ConfigError("train(resume_from_checkpoint=...) continues a run covey must restore before it "
                              "builds the policy: set GRPOConfig(resume_from_checkpoint=...) ('auto' or a folder) "
                              "and build the trainer with it")
        clock = TrainingClock(self.global_step)
        if args.keep_freed_memory:
            keep_freed_memory()
        self.run = dataclasses.replace(self.run, run_dir=self.world.on_main(lambda: open_run_dir(self.run,
                                                                                                  self.global_step)))
        run, callbacks = self.run, self.callback_handler
        callbacks.args = CallbackArgs(args, self.run_dir, self.world)  # the folder as claimed
        trackers = make_trackers(args.report_to, self.run_dir, args.run_name or self.run_dir.name, run.config_as_used,
                                 first_step=self.global_step + 1, project=args.project) if self.world.is_main else []
        parts = self.parts
        with (parts.rewards.pool, parts.sampler.agent or contextlib.nullcontext(),  # its tool worker
              RunLog(self.run_dir, args.max_steps, quiet=self.quiet, trackers=trackers, record=self.world.is_main) as log,
              between_steps.stop_on_signals(log, self.world.size) as stop, run.hub or contextlib.nullcontext(),
              parts.policy.summing_gradients(self.world, args.gradient_checkpointing)):
            take_stop_counts()  # calls stopped before this run (another trainer's) are not its own
            callbacks.call("on_train_begin", self.global_step)
            if note := defaults_note(args):
                log.info(note)
            if run.resume_from is not None:
                log.resume(self.history, self.global_step)
                log.info(f"resumed from {run.resume_from} at step {self.global_step}")
            elif self.eval_rows:
                before = self.held_out_result()
                self.run_state = dataclasses.replace(self.run_state, before=before)
                log.info(f"held-out accuracy before training: {percent(before['accuracy'])} "
                         f"(mean reward {before['mean_reward']:.3f}, n={before['n']})")
            self._train_steps(log, stop)
            final = save_final_model(run, self.run_state)  # before anything else can fail
            after = self.held_out_result() if self.eval_rows else None
        self.summary = self.world.on_main(lambda: write_summary(run, self.run_state, final, after))
        metrics = clock.closing_metrics(
            self.global_step, args.per_device_train_batch_size * args.gradient_accumulation_steps * self.world.size,
            self.history)
        callbacks.log(self.global_step, closing_entry(self.history, self.global_step, metrics))
        callbacks.call("on_train_end", self.global_step)
        if run.hub is not None:
            callbacks.call("on_push_begin", self.global_step)
            for line in run.hub.push_final(final):
                log.info(line)
        if not self.quiet:
            print_summary(log.console, self.run_state.before, after, self.run_dir)
        return TrainOutput(self.global_step, metrics["train_loss"], metrics)

    def _train_steps(self, log: RunLog, stop: StopRequest) -> None:
        """The steps up to max_steps (or a callback's stop), each followed by what comes between steps."""
        run, callbacks = self.run, self.callback_handler
        with run.parts.sampler.generating_ahead(self._worker_ahead()):
            self.run_state = dataclasses.replace(self.run_state, in_flight=None)  # the worker holds them now
            while self.global_step < run.args.max_steps and not callbacks.stop_asked():
                steps_before, passes_before = self.global_step, self.passes_trained
                result = grpo_step(run.parts, run.prompt_sampler, self.progress, callbacks)
                self.run_state = dataclasses.replace(self.run_state, progress=result.progress)
                evaluation = between_steps.evaluate_if_due(run, self.run_state, callbacks, log, steps_before,
                                                           self.held_out_result)
                self.run_state, whole = between_steps.log_step(run, self.run_state, callbacks, log, result, evaluation)
                between_steps.after_step(run, self.run_state, callbacks, log, stop, steps_before, passes_before,
                                         whole.records() if whole is not None else [])
        if self.global_step < run.args.max_steps:  # only a callback ends the loop early
            log.info(f"a callback stopped the training at step {self.global_step} of {run.args.max_steps}")

    def _worker_ahead(self) -> AsyncGeneration | None:
        """Under async_generation, the worker that samples the next rounds (first those a resumed checkpoint
        held in flight), over an engine of its own or the run's shared one."""
        if not self.args.async_generation:
            return None
        args, sampler = self.args, self.parts.sampler
        return AsyncGeneration(self.parts, self.prompt_sampler, AsyncSchedule.from_args(args),
                               lambda model: setup.build_engine(args, model, sampler.tokenizer, sampler.eos_ids),
                               generate_and_score, self.progress, self.run_state.in_flight)

    # ---- what TRL's scripts call after train() ------------------------------------------------

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """The trained model with its tokenizer, where TRL's scripts ask for it: the run folder (or None)
        means its final_model/, which train() wrote; another folder gets a copy, and must not hold files."""
        final = self.run_dir / "final_model"
        if output_dir is None or Path(output_dir).resolve() in (self.run_dir.resolve(), final.resolve()):
            return final if final.is_dir() else save_final_model(self.run, self.run_state)
        target = Path(output_dir)
        if target.exists() and any(target.iterdir()):
            raise ConfigError(f"save_model: {target} already holds files, and covey overwrites nothing; give a new "
                              f"or empty folder (the model is also in {final})")

        return write_model(self.run, target)

    def push_to_hub(self, commit_message: str | None = None, **_: Any) -> str:
        """The repo train() pushed the final model to (push_to_hub: true pushes at the end of train(), as
        TRL's scripts then ask again); without push_to_hub nothing was checked, so nothing is pushed now."""
        if self.run.hub is None:
            raise ConfigError("push_to_hub() pushes what train() sends to the Hub under push_to_hub: true, which "
                              "checks the token and the repo before any model loads; set push_to_hub: true, or "
                              f"upload {self.run_dir / 'final_model'} with `hf upload`")
        return self.run.hub.url

    @property
    def passes_trained(self) -> int:
        """Whole passes over the training prompts trained on (under async_generation the sampler, shared
        with the worker, is rounds ahead)."""
        return self.prompt_sampler.passes_in(self.progress.rounds_sampled)

    @property
    def epochs_trained(self) -> float:
        """The passes over the training prompts trained on, a fraction within the last (the epoch of logs,
        callbacks and evaluations)."""
        return self.prompt_sampler.progress_in(self.progress.rounds_sampled)

    def held_out_result(self, rows: list[dict] | None = None) -> dict:
        """Greedy accuracy and mean reward on held-out rows (default: the configured eval split), with
        the samples; ``evaluate()`` gives the same under TRL's metric names."""
        rows = rows if rows is not None else self.eval_rows
        if not rows:
            raise ConfigError("no held-out data to evaluate on: set eval_dataset")
        rewards = self.parts.rewards
        state = TrainerState(global_step=self.global_step, max_steps=self.args.max_steps, epoch=self.epochs_trained)
        # every process evaluates its share of the rows
        sampler = self.parts.sampler
        with sampler.from_policy(self.parts.policy, self.world):
            mine = evaluate(sampler.engine, sampler.tokenizer, self.world.share(rows), rewards.funcs, rewards.weights,
                            self.args, rewards.pool, reward_context(state), agent=sampler.agent,
                            rollout_func=sampler.rollout_func, eos_ids=sampler.eos_ids, processor=sampler.processor)
        parts = self.world.gather(mine)
        result = merge_evaluations(parts)
        self.callback_handler.evaluate(self.global_step, result)
        return result

    def held_out_loss(self, rows: list[dict]) -> float:
        """The GRPO loss on held-out ``rows`` (``trl_api.grpo_loss_on``), averaged over the processes. Each
        process scores every row (its own samples): a sharded model's passes must come in step."""
        train_rows, ids, _ = setup.encode_training_prompts(self.args, self.tokenizer, rows, "eval_dataset",
                                                           self.parts.sampler.agent, self.parts.sampler.processor)
        with self.parts.sampler.from_policy(self.parts.policy, self.world):
            losses = self.world.gather(grpo_loss_on(self.parts, Prompts(train_rows, ids)))
        return sum(losses) / len(losses)


def run_config(args: Any, quantization_config: Any = None) -> GRPOConfig:
    """The config a trainer runs with: covey's own, checked again (a script may have set fields since it was
    made, as TRL's set ``model_init_kwargs``), or a TRL ``GRPOConfig`` read field by field; with TRL's
    ``quantization_config`` as covey's loading fields. A copy: changing ``args`` later changes no run."""
    if args is None:
        args = GRPOConfig()
    elif not isinstance(args, GRPOConfig):
        if not dataclasses.is_dataclass(args) or "num_generations" not in {f.name for f in dataclasses.fields(args)}:
            raise ConfigError(f"args must be a GRPOConfig (covey's or TRL's), not {type(args).__name__}")
        args = GRPOConfig.from_trl(args)
    return args.replace(**quantization_settings(quantization_config, args.dtype))


class AsyncGRPOTrainer(GRPOTrainer):
    """TRL's ``AsyncGRPOTrainer`` (stable from TRL 1.18): a GRPOTrainer whose config generates ahead of
    training (``AsyncGRPOConfig``, or any GRPOConfig with ``async_generation: true``)."""

    def __init__(self, model: Any = None, reward_funcs: Any = None, args: GRPOConfig | None = None, **kwargs: Any):
        from covey.config import AsyncGRPOConfig

        args = args if args is not None else AsyncGRPOConfig()
        if not args.async_generation:
            raise ConfigError("AsyncGRPOTrainer trains while the next rounds are generated, and this config has "
                              "async_generation: false; give an AsyncGRPOConfig, or use GRPOTrainer")
        super().__init__(model, reward_funcs, args, **kwargs)
