"""The GRPO trainer: set-up, the loop of steps, checkpoints and what a run writes.

Each step is ``covey.train.step.grpo_step``: generate, score, advantages, log-probs, loss,
optimizer step. The trainer builds its parts once (``StepParts``), keeps where the run stands
(``Progress``) between steps, logs what each step returns, checkpoints between steps and writes
the run folder. Under several processes (``covey.train.distributed``) the first records the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import signal
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import yaml

from covey.agents import ToolCallFormat
from covey.config import RESUME_FIELDS, SYNC_WITH_LORA, VESPO_SEQUENCE_CORRECTION, GRPOConfig
from covey.data import PromptSampler
from covey.errors import CheckpointError, ConfigError, NumericsError, TrainingInterrupted
from covey.models import (Reference, eos_token_ids, is_peft_model, keep_freed_memory, load_tokenizer, prepare_tokenizer,
                          resolve_model_path, set_log_level, tokenizer_as_loaded)
from covey.rewards import RewardFunc, RewardModel, RewardPool, TrainerState, reward_context
from covey.rewards.stoppable import take_stop_counts
from covey.rollout import RolloutEngine
from covey.rollout.vllm_engine import check_vllm
from covey.telemetry.runlog import RunLog, latest_run_config, write_json
from covey.telemetry.tables import accuracy_change, model_card, percent, print_summary
from covey.telemetry.trackers import check_trackers, make_trackers
from covey.train import setup
from covey.train.asynchronous import AsyncGeneration, AsyncSchedule, check_async_run
from covey.train.batch import Progress, Prompts, ScoredBatch, StepResult
from covey.train.callbacks import CallbackArgs, Callbacks, check_callbacks
from covey.train.checkpoint import (IN_FLIGHT, load_checkpoint, resolve_checkpoint, rng_states, save_checkpoint,
                                    save_sharded, saved_step, sharded_staging, written_whole)
from covey.train.distributed import World, check_launcher_settings, sharded_part
from covey.train.evaluation import evaluate, merge_evaluations
from covey.train.forward import TrainingForward
from covey.train.hub import HubPush
from covey.train.metrics import interval_mean, step_metrics
from covey.train.sharding import Sharding, check_sharded_run, whole_state_dict
from covey.train.run_folder import claim_run_dir, config_as_used, make_run_dir, write_run_config
from covey.train.step import Rewards, StepParts, generate_and_score, grpo_step, sampling_from_policy
from covey.train.trl_api import TRLSurface, TrainingClock, closing_entry, held_out_loss, named_eval_sets

# hyperparameters the model card lists, as the run used them
MODEL_CARD_FIELDS = ("loss_type", "learning_rate", "num_generations", "max_completion_length", "beta", "epsilon",
                     "epsilon_high", "scale_rewards", "temperature", "num_iterations", "use_peft", "seed")


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
                 args: GRPOConfig | None = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, peft_config: Any = None, rollout_engine: RolloutEngine | None = None,
                 quiet: bool = False, tools: Sequence[Callable | str] | None = None,
                 environment_factory: Callable[[], Any] | None = None,
                 rollout_func: Callable[[list, GRPOTrainer], dict] | None = None,
                 tool_call_format: ToolCallFormat | None = None, reward_processing_classes: Any = None,
                 callbacks: Sequence[Any] | None = None):
        self.args = args = args or GRPOConfig()
        check_callbacks(callbacks or [])
        if ((processes := World.launched_size()) > 1 and rollout_engine is None and args.rollout_engine == "vllm"
                and args.vllm_mode == "colocate"):
            raise ConfigError(f"rollout_engine: vllm with vllm_mode: colocate runs in a single process, and this run "
                              f"has {processes} (WORLD_SIZE); with several processes use vllm_mode: server (one "
                              "`covey server` for all of them) or rollout_engine: fast, or train in one process")
        check_launcher_settings(args.bf16)
        self.sharding = Sharding.from_settings(args.fsdp, args.fsdp_config, os.environ)  # None: not sharded
        if self.sharding is not None:
            check_sharded_run(args)
        self.world = World.from_environment(args.ddp_timeout)
        set_log_level(args.log_level)
        if callable(reward_funcs) or isinstance(reward_funcs, str):
            reward_funcs = [reward_funcs]
        setup.check_data_and_rewards_given(args, train_dataset, reward_funcs, environment_factory)
        funcs, weights = setup.load_rewards(args, reward_funcs, reward_processing_classes)
        environment = setup.load_environment(args, environment_factory)
        if environment is not None:  # environments that score their episodes (get_reward) are rewards too (TRL's)
            scored = environment.reward_functions()
            funcs, weights = [*funcs, *scored], [*weights, *[1.0] * len(scored)]
        if not funcs:
            raise ConfigError("No reward source provided: reward_funcs is empty, and no environment defines "
                              "get_reward; give reward_funcs=[...] or define get_reward")
        if rollout_func is not None and (tools or args.tools or environment is not None):
            raise ConfigError("rollout_func generates the completions itself, so tools and environment_factory would "
                              "go unused: give one or the other")
        self.config_as_used = config_as_used(args, model, train_dataset, eval_dataset, reward_funcs, peft_config,
                                             tools, environment_factory)
        rewards = Rewards(funcs, weights, RewardPool(funcs, args.reward_num_workers, args.num_generations))
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset  # as given (TRL's members)
        if eval_dataset is not None:  # several named sets (a dict, a DatasetDict) are evaluated together
            eval_dataset = [dict(row) for rows in named_eval_sets(eval_dataset).values() for row in rows]
        rows = setup.load_run_rows(args, train_dataset, eval_dataset, funcs, self.world.size, environment,
                                   own_rollouts=rollout_func is not None)
        self.dataset_name, self.eval_rows = rows.source, rows.heldout
        if args.eval_strategy == "steps" and not self.eval_rows:
            raise ConfigError(f"eval_strategy: steps evaluates on held-out data, and {rows.source} brings none: give "
                              "eval_dataset (or a built-in task), or set eval_strategy: no")
        check_trackers(args.report_to)
        if tool_call_format is not None and not (tools or args.tools or environment is not None):
            raise ConfigError("tool_call_format reads tool calls, and this run has no tools or environment_factory: "
                              "give tools, or leave tool_call_format out")
        # where the model comes from: its folder or hub id
        source = (model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
                  ) or (args.model if model is None else None)
        if source is None and processing_class is None:
            raise ConfigError("the model object has no name or folder to load its tokenizer from "
                              "(config._name_or_path is empty): give processing_class=its tokenizer")
        if rollout_engine is not None:
            setup.check_engine(rollout_engine, episodes=bool(tools or args.tools or environment is not None))
        elif setup.engine_name(args) == "vllm":
            check_vllm(args.vllm_enable_sleep_mode, resolve_model_path(source) if source else None)
        check_async_run(args, self.world.size, rollout_engine, rollout_func is not None,
                        setup.engine_name(args) == "server" or getattr(rollout_engine, "shared_by_processes", False))
        if args.sync_ref_model and (peft_config is not None or is_peft_model(model)):
            raise ConfigError(SYNC_WITH_LORA)
        setup.check_model_settings(args, model, peft_config)
        self.resume_from = (resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
                            if args.resume_from_checkpoint else None)
        if args.max_steps != -1:
            self._check_resumed_step()
        self.run_dir = self.world.on_main(lambda: make_run_dir(args, self.resume_from))
        self.hub = HubPush.connect(args, self.run_dir, self.world)  # None but in the first process under push_to_hub
        torch.manual_seed(self.world.seed(args.seed))  # dropout masks of its own in each process

        if processing_class is not None:
            tokenizer = processing_class
            prepare_tokenizer(tokenizer)
        else:
            tokenizer = load_tokenizer(source, args.trust_remote_code, args.model_revision)
        for chats in [tokenizer] + [f.tokenizer for f in funcs if isinstance(f, RewardModel)]:
            chats.covey_chat_template_kwargs = args.chat_template_kwargs or {}  # read by render_chat
        agent = setup.build_agent(args, tokenizer, tools, environment, tool_call_format)
        train_rows, prompt_ids, self.prompt_overflow_count = setup.encode_training_prompts(
            args, tokenizer, rows.train, rows.source, agent)
        if args.max_steps == -1:  # num_train_epochs passes over the prompts kept, as a number of steps from here on
            self.args = args = dataclasses.replace(
                args, max_steps=args.steps_for_epochs(len(train_rows), self.world.size), num_train_epochs=None)
            self._check_resumed_step()

        policy = setup.build_policy(args, model, peft_config)
        setup.check_vocabulary(policy, tokenizer)
        self.world.check_device(next(policy.parameters()).device)
        self.world.broadcast_parameters(policy)
        if args.sync_ref_model and is_peft_model(policy):  # a folder that held a LoRA adapter
            raise ConfigError(SYNC_WITH_LORA)
        if model is None or isinstance(model, str):
            self.model_name = model or args.model
        else:
            self.model_name = getattr(getattr(model, "config", None), "_name_or_path", None) or "a model object"
        reference = Reference(policy) if args.beta > 0 else None
        self.eos_ids = eos_token_ids(policy, tokenizer)
        if agent is not None:  # a turn ends at any of the model's end tokens
            agent = dataclasses.replace(agent, eos_ids=self.eos_ids)
        sharded = (None if self.sharding is None else
                   setup.shard_run(args, self.sharding, policy, reference, rollout_engine is not None, self.world))
        sampled = policy if sharded is None or sharded.policy_copy is None else sharded.policy_copy.model
        engine = rollout_engine or setup.build_engine(args, sampled, tokenizer, self.eos_ids)
        correction = setup.engine_correction(args)
        if (args.loss_type == "vespo" and correction is not None and correction.level == "sequence"
                and not (engine.exact_logprobs and rollout_func is None)):
            raise ConfigError(f"{VESPO_SEQUENCE_CORRECTION} (this run's {type(engine).__name__} samples from other "
                              "log-probs than the trainer's, so the correction applies)")
        if rollout_engine is not None or (self.world.size > 1 and engine.shared_by_processes):
            # whatever it holds, it samples from the policy: pushed before sampling (by the first process)
            engine.policy_changed(policy)
        optimizer = setup.make_optimizer(args, policy, self.world)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, setup.lr_schedule(args))
        # the prompts of every process, drawn together; each takes its share (World.share)
        self.sampler = PromptSampler(len(train_rows), args.prompts_per_round(self.world.size), args.seed,
                                     args.shuffle_dataset)
        self.parts = StepParts(args, self.world, policy, reference, engine, tokenizer, self.eos_ids,
                               Prompts(train_rows, prompt_ids), rewards, optimizer, scheduler,
                               setup.sampling_params(args),
                               setup.loss_settings(args, setup.router_aux_loss_coef(args, policy)), correction,
                               agent, None if rollout_func is None else lambda prompts: rollout_func(prompts, self),
                               **({} if sharded is None else vars(sharded)))
        self.quiet = quiet or not self.world.is_main
        self.progress = Progress(entropy_coef=args.entropy_coef)
        self.before: dict | None = None  # the evaluation before training
        self.summary: dict | None = None  # what train() wrote to summary.json
        self.history: list[dict] = []  # logged metrics, restored on resume
        self.unlogged_metrics: list[dict] = []  # the steps since the last logged one (averaged into the next)
        self.stop_signal: int | None = None  # SIGINT/SIGTERM received: checkpoint and stop after this step
        self.in_flight: dict | None = None  # async_generation: the rounds in flight a checkpoint resumed holds
        if self.resume_from is not None:
            self._restore(self.resume_from)
        self.callback_handler = Callbacks(callbacks or [], CallbackArgs(args, self.run_dir, self.world), self.world,
                                          self.sampler, lambda: self.epochs_trained, model=policy,
                                          processing_class=tokenizer, optimizer=optimizer, lr_scheduler=scheduler)
        self.callback_handler.log_history.extend(self.history)
        self.callback_handler.call("on_init_end", self.global_step)

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.progress.global_step

    # the run's parts, as the step holds them
    reference = property(lambda self: self.parts.reference, doc="The reference model (None when beta == 0).")
    engine = property(lambda self: self.parts.engine, doc="The rollout engine.")
    tokenizer = property(lambda self: self.parts.tokenizer)
    processing_class = tokenizer  # TRL's name, which rollout functions read
    optimizer = property(lambda self: self.parts.optimizer)
    scheduler = property(lambda self: self.parts.scheduler)
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

    def _check_resumed_step(self) -> None:
        if self.resume_from is not None and (resumed_at := saved_step(self.resume_from)) > self.args.max_steps:
            raise ConfigError(f"{self.resume_from} is at step {resumed_at}, beyond max_steps="
                              f"{self.args.max_steps}: raise max_steps to continue the run, or resume from an earlier "
                              "checkpoint")

    # ---- the loop ---------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **_: Any):
        """Run max_steps optimizer steps. Returns transformers' ``TrainOutput`` (global_step, training_loss,
        metrics), whose metrics also close state.log_history; ``self.summary`` is what summary.json holds.
        ``resume_from_checkpoint`` (TRL's argument) is the config's field of that name."""
        from transformers.trainer_utils import TrainOutput

        args = self.args
        if resume_from_checkpoint not in (None, False) and self.resume_from is None:
            raise ConfigError("train(resume_from_checkpoint=...) continues a run covey must restore before it "
                              "builds the policy: set GRPOConfig(resume_from_checkpoint=...) ('auto' or a folder) "
                              "and build the trainer with it")
        clock = TrainingClock(self.global_step)
        if args.keep_freed_memory:
            keep_freed_memory()
        self.run_dir = self.world.on_main(self._open_run_dir)
        callbacks = self.callback_handler
        callbacks.args = CallbackArgs(args, self.run_dir, self.world)  # the folder as claimed
        trackers = make_trackers(args.report_to, self.run_dir, args.run_name or self.run_dir.name, self.config_as_used,
                                 first_step=self.global_step + 1, project=args.project) if self.world.is_main else []
        with (self.parts.rewards.pool, self.parts.agent or contextlib.nullcontext(),  # its tool worker
              RunLog(self.run_dir, args.max_steps, quiet=self.quiet, trackers=trackers,
                     record=self.world.is_main) as log,
              self._stop_on_signals(log), self.hub or contextlib.nullcontext(), self._gradients_summed()):
            take_stop_counts()  # calls stopped before this run (another trainer's) are not its own
            callbacks.call("on_train_begin", self.global_step)
            if self.resume_from is not None:
                log.resume(self.history, self.global_step)
                log.info(f"resumed from {self.resume_from} at step {self.global_step}")
            elif self.eval_rows:
                self.before = self.held_out_result()
                log.info(f"held-out accuracy before training: {percent(self.before['accuracy'])} "
                         f"(mean reward {self.before['mean_reward']:.3f}, n={self.before['n']})")
            with self._generating_ahead():
                while self.global_step < args.max_steps and not callbacks.stop_asked():
                    steps_before, passes_before = self.global_step, self.passes_trained
                    result = grpo_step(self.parts, self.sampler, self.progress, callbacks)
                    self.progress = result.progress
                    whole = self._log_step(log, result, self._evaluate_if_due(log, steps_before))
                    self._after_step(log, steps_before, passes_before, whole.records() if whole is not None else [])
            if self.global_step < args.max_steps:  # only a callback ends the loop early
                log.info(f"a callback stopped the training at step {self.global_step} of {args.max_steps}")
            final = self._save_final_model()  # before anything else can fail
            after = self.held_out_result() if self.eval_rows else None
        self.summary = self.world.on_main(lambda: self._write_outputs(final, self.before, after, log.history))
        metrics = clock.closing_metrics(
            self.global_step, args.per_device_train_batch_size * args.gradient_accumulation_steps * self.world.size,
            self.history)
        callbacks.log(self.global_step, closing_entry(self.history, self.global_step, metrics))
        callbacks.call("on_train_end", self.global_step)
        if self.hub is not None:
            callbacks.call("on_push_begin", self.global_step)
            for line in self.hub.push_final(final):
                log.info(line)
        if not self.quiet:
            print_summary(log.console, self.before, after, self.run_dir)
        return TrainOutput(self.global_step, metrics["train_loss"], metrics)

    @contextlib.contextmanager
    def _generating_ahead(self):
        """Under async_generation, the worker that samples the next rounds, for the training loop."""
        if not self.args.async_generation:
            yield
            return
        worker = AsyncGeneration(self.parts, self.sampler, AsyncSchedule.from_args(self.args),
                                 lambda model: setup.build_engine(self.args, model, self.tokenizer, self.eos_ids),
                                 generate_and_score, self.progress, self.in_flight)
        self.in_flight = None
        self.parts = dataclasses.replace(self.parts, asynchronous=worker)
        try:
            with worker:
                yield
        finally:
            self.parts = dataclasses.replace(self.parts, asynchronous=None)

    # ---- what TRL's scripts call after train() ------------------------------------------------

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """The trained model with its tokenizer, where TRL's scripts ask for it: the run folder (or None)
        means its final_model/, which train() wrote; another folder gets a copy, and must not hold files."""
        final = self.run_dir / "final_model"
        if output_dir is None or Path(output_dir).resolve() in (self.run_dir.resolve(), final.resolve()):
            return final if final.is_dir() else self._save_final_model()
        target = Path(output_dir)
        if target.exists() and any(target.iterdir()):
            raise ConfigError(f"save_model: {target} already holds files, and covey overwrites nothing; give a new "
                              f"or empty folder (the model is also in {final})")

        return self._write_model(target)

    def _write_model(self, folder: Path) -> Path:
        """The model and its tokenizer (as loaded) in ``folder``, whole or not at all, by the first process
        (a sharded model gathered there first, with every process's help)."""
        whole = self._whole_model_state()
        return self.world.on_main(lambda: self._write_model_here(folder, whole))

    def _whole_model_state(self) -> dict | None:
        """Under fsdp, the policy's whole state dict on the first process (every process takes part); else
        None, where the model writes its own."""
        return None if self.parts.policy_pass is None else whole_state_dict(self.parts.policy_pass)

    def _write_model_here(self, folder: Path, state_dict: dict | None) -> Path:
        with written_whole(folder, f"{folder.name}-*") as tmp:
            self.model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
            with tokenizer_as_loaded(self.tokenizer) as tokenizer:
                tokenizer.save_pretrained(tmp)
        return folder

    def push_to_hub(self, commit_message: str | None = None, **_: Any) -> str:
        """The repo train() pushed the final model to (push_to_hub: true pushes at the end of train(), as
        TRL's scripts then ask again); without push_to_hub nothing was checked, so nothing is pushed now."""
        if self.hub is None:
            raise ConfigError("push_to_hub() pushes what train() sends to the Hub under push_to_hub: true, which "
                              "checks the token and the repo before any model loads; set push_to_hub: true, or "
                              f"upload {self.run_dir / 'final_model'} with `hf upload`")
        return self.hub.url

    @contextlib.contextmanager
    def _gradients_summed(self):
        """Over several processes, DistributedDataParallel over the training pass while train() runs. It
        is released at the end, while the process group is still open: released after it is closed (at
        exit, say), gloo's teardown can deadlock against the thread that finishes its last transfers."""
        forward = self.parts.policy_pass or self.world.data_parallel(  # sharded: FSDP2 reduces the gradients
            TrainingForward(self.model), static_graph=self.args.gradient_checkpointing)
        self.parts = dataclasses.replace(self.parts, training_forward=forward)
        try:
            yield
        finally:
            self.parts = dataclasses.replace(self.parts, training_forward=None)
            del forward
            gc.collect()  # its reducer sits in reference cycles

    def _open_run_dir(self) -> Path:
        """The run folder, taken for this run (or reopened to resume it), with the run's config saved."""
        if self.resume_from is None:
            self.run_dir = claim_run_dir(self.run_dir, self.args)
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._save_config()
        return self.run_dir

    def _evaluate_if_due(self, log: RunLog, steps_before: int) -> dict[str, float]:
        """The held-out evaluation under eval_strategy: steps when the step crossed a multiple of eval_steps,
        or when a callback asks for one (before the last step: the evaluation after training comes then),
        as ``eval/...`` metrics; else none."""
        args, step = self.args, self.global_step
        due = args.eval_strategy == "steps" and _crossed(steps_before, step, args.eval_steps or args.logging_steps)
        asked = self.callback_handler.take("should_evaluate")  # by a callback
        if step >= args.max_steps or self.callback_handler.stopping or not (due or asked):
            return {}  # the evaluation after training comes next
        if not self.eval_rows:
            log.info(f"[yellow]step {step}: a callback asked for an evaluation (control.should_evaluate), and this "
                     "run has no held-out data (eval_dataset): none is made[/]")
            return {}
        result = self.held_out_result()
        mean = "n/a" if result["mean_reward"] is None else f"{result['mean_reward']:.3f}"
        log.info(f"step {step}: held-out accuracy {percent(result['accuracy'])} (mean reward {mean}, n={result['n']})")
        return {f"eval/{key}": math.nan if result[key] is None else result[key] for key in ("accuracy", "mean_reward")}

    def _log_step(self, log: RunLog, result: StepResult, evaluation: dict[str, float]) -> ScoredBatch | None:
        """The metrics of each of the step's optimizer steps, over the batch of every process (gathered on
        the first, which returns it; None on the others), logged as logging_steps or a callback says;
        ``evaluation`` (held-out metrics after the step) joins the last, which is then logged whatever
        logging_steps says, as is the last before a callback's stop. A step that ended on too many skipped
        optimizer steps in a row stops the run, once its metrics are written."""
        args, callbacks = self.args, self.callback_handler
        merged = self._merged_on_main(result)
        for update in result.updates:
            last = update is result.updates[-1]
            if merged is not None:
                whole, reward_metrics, dynamic_sampling = merged
                self.unlogged_metrics.append({**step_metrics(
                    whole, update, self.parts.rewards.names, self.parts.rewards.weights_F, reward_metrics,
                    dynamic_sampling, result.progress.reward_errors, args.beta > 0), **(evaluation if last else {})})
            asked = callbacks.take("should_log", update.global_step)
            if (update.global_step % args.logging_steps == 0 or update.global_step == args.max_steps or asked
                    or (args.logging_first_step and update.global_step == 1)
                    or (last and (evaluation or callbacks.stopping))):
                self._write_metrics(log, update.global_step)
        if (bad := result.progress.consecutive_bad_steps) >= args.max_consecutive_bad_steps:
            if self.unlogged_metrics:  # the steps up to the failing one, whatever logging_steps says
                self._write_metrics(log, result.progress.global_step)
            raise NumericsError(f"{bad} steps in a row had NaN/inf gradients (step {result.progress.global_step}); "
                                "lower the learning rate, check the rewards for NaN/inf, or try bf16: false")
        self.history = log.history
        return None if merged is None else merged[0]

    def _write_metrics(self, log: RunLog, step: int) -> None:
        """Log the mean of the metrics since the last logged step, as of ``step``, and tell the callbacks."""
        metrics = interval_mean(self.unlogged_metrics)
        log.log_metrics(step, metrics)
        self.callback_handler.log(step, metrics)
        self.unlogged_metrics = []

    def _merged_on_main(self, result: StepResult) -> tuple[ScoredBatch, dict, dict] | None:
        """The step's batch of every process in rank order, what their reward functions logged and their
        dynamic-sampling counts, on the first process (None on the others)."""
        parts = self.world.gather_on_main((result.batch, result.reward_metrics, result.dynamic_sampling))
        if parts is None:
            return None
        reward_metrics: dict[str, list[float]] = {}
        for _, logged, _ in parts:
            for name, values in logged.items():
                reward_metrics.setdefault(name, []).extend(values)
        dynamic_sampling = {  # every process runs the same number of extra rounds
            key: (max if key == "dynamic_sampling/extra_rounds" else sum)(counts[key] for _, _, counts in parts)
            for key in result.dynamic_sampling}
        return ScoredBatch.concat([batch for batch, _, _ in parts], self.tokenizer.pad_token_id), reward_metrics, \
            dynamic_sampling

    @property
    def passes_trained(self) -> int:
        """Whole passes over the training prompts trained on (under async_generation the sampler, shared
        with the worker, is rounds ahead)."""
        return self.sampler.passes_in(self.progress.rounds_sampled)

    @property
    def epochs_trained(self) -> float:
        """The passes over the training prompts trained on, a fraction within the last (the epoch of logs,
        callbacks and evaluations)."""
        return self.sampler.progress_in(self.progress.rounds_sampled)

    def _after_step(self, log: RunLog, steps_before: int, passes_before: int, records: list[dict]) -> None:
        """After a step's optimizer steps (``steps_before`` were taken before it, ``passes_before`` passes
        over the prompts drawn): record its completions when due, then checkpoint as save_strategy says,
        when a callback asks, or when asked to stop. Checkpoints fall between steps, where the state is
        small and complete."""
        args, step, callbacks = self.args, self.global_step, self.callback_handler
        if args.log_completions and (steps_before == 0 or step == args.max_steps or callbacks.stopping
                                     or _crossed(steps_before, step, args.log_completions_steps)):
            log.log_completions(step, records, args.num_completions_to_print)
        # a signal to any process stops them all; one in the last step: just finish
        stop_signal = next((s for s in self.world.gather(self.stop_signal) if s is not None), None)
        stopping = stop_signal is not None and step < args.max_steps
        if args.save_strategy == "steps":
            due = args.save_steps > 0 and _crossed(steps_before, step, args.save_steps)
        else:
            due = args.save_strategy == "epoch" and self.passes_trained > passes_before
        if not (callbacks.take("should_save") or due or stopping):
            return
        path = self._checkpoint_every_process()
        log.info(f"checkpoint saved: {path}")
        callbacks.call("on_save", step)
        if self.hub is not None:
            callbacks.call("on_push_begin", step)
            progress = f"epoch {self.passes_trained}" if args.save_strategy == "epoch" else f"step {step}"
            for line in self.hub.push_checkpoint(path, f"Training in progress, {progress}"):
                log.info(line)
        if stopping:
            raise TrainingInterrupted(
                f"stopped by {signal.Signals(stop_signal).name} at step {step}; checkpoint saved in {path}. "
                f"Continue with: covey train CONFIG --output-dir {self.run_dir} --resume-from-checkpoint auto",
                stop_signal)

    def held_out_result(self, rows: list[dict] | None = None) -> dict:
        """Greedy accuracy and mean reward on held-out rows (default: the configured eval split), with
        the samples; ``evaluate()`` gives the same under TRL's metric names."""
        rows = rows if rows is not None else self.eval_rows
        if not rows:
            raise ConfigError("no held-out data to evaluate on: set eval_dataset")
        rewards = self.parts.rewards
        state = TrainerState(global_step=self.global_step, max_steps=self.args.max_steps, epoch=self.epochs_trained)
        # every process evaluates its share of the rows
        with self._sampling_from_policy():
            mine = evaluate(self.engine, self.tokenizer, self.world.share(rows), rewards.funcs, rewards.weights,
                            self.args, rewards.pool, reward_context(state), agent=self.parts.agent,
                            rollout_func=self.parts.rollout_func, eos_ids=self.eos_ids)
        parts = self.world.gather(mine)
        result = merge_evaluations(parts)
        self.callback_handler.evaluate(self.global_step, result)
        return result

    @contextlib.contextmanager
    def _sampling_from_policy(self):
        """The engine sampling from the trained policy outside a step (an asynchronous worker's lent back)."""
        lent = self.parts.asynchronous.engine_lent() if self.parts.asynchronous else contextlib.nullcontext()
        with lent, sampling_from_policy(self.parts):
            yield

    def held_out_loss(self, rows: list[dict]) -> float:
        """The GRPO loss on held-out ``rows`` (``trl_api.held_out_loss``), averaged over the processes. Each
        process scores every row (its own samples): a sharded model's passes must come in step."""
        train_rows, ids, _ = setup.encode_training_prompts(self.args, self.tokenizer, rows, "eval_dataset",
                                                           self.parts.agent)
        with self._sampling_from_policy():
            losses = self.world.gather(held_out_loss(self.parts, Prompts(train_rows, ids)))
        return sum(losses) / len(losses)

    # ---- checkpoints ------------------------------------------------------------------------

    def _checkpoint_every_process(self) -> Path:
        """A checkpoint, written by the first process with what the others send it: their random states
        (each resumes its own streams), their parts of a sharded optimizer state, and under
        async_generation the rounds each process's worker sampled ahead, the worker held meanwhile (its
        prompt sampler at the worker's position; a resumed run trains those rounds next). Its path."""
        worker = self.parts.asynchronous
        with worker.held() if worker is not None else contextlib.nullcontext() as in_flight:
            return self._write_checkpoint(self.world.gather(in_flight) if worker is not None else None)

    def _write_checkpoint(self, in_flight: list | None) -> Path:
        """The checkpoint as this run's layout writes it (whole, sharded, or the model alone), with
        ``in_flight``: each process's rounds sampled ahead (None without async_generation)."""
        policy_pass = self.parts.policy_pass
        if self.args.save_only_model:  # the model alone, whole (gathered first where it is sharded)
            whole = self._whole_model_state()
            return self.world.on_main(lambda: self.save_checkpoint(model_state=whole, in_flight=in_flight))
        if policy_pass is not None:  # every process writes its shards, then the first the rest
            staging = self.world.on_main(lambda: sharded_staging(self.run_dir, self.global_step))
            save_sharded(staging, policy_pass, self.optimizer,
                         self.parts.reference_pass if self._moving_reference() is not None else None)
            with_model = self.sharding.whole_model_in_checkpoints  # state_dict_type: FULL_STATE_DICT
            whole = self._whole_model_state() if with_model else None
            process_rngs = self.world.gather(rng_states())
            return self.world.on_main(lambda: self.save_checkpoint(process_rngs[1:], sharded=staging, model_state=whole,
                                                                   whole_model=with_model, in_flight=in_flight))
        sharded = sharded_part(self.optimizer) is not None
        optimizer_state = self.world.gather_optimizer_state(self.optimizer) if sharded else None
        process_rngs = self.world.gather(rng_states())
        return self.world.on_main(lambda: self.save_checkpoint(process_rngs[1:], optimizer_state, in_flight=in_flight))

    def save_checkpoint(self, other_processes_rng: list = (), optimizer_state: dict | None = None,
                        sharded: Path | None = None, model_state: dict | None = None,
                        whole_model: bool = False, in_flight: list | None = None) -> Path:
        """Write checkpoints/checkpoint-<step> (atomically) and prune old ones; its path.
        ``other_processes_rng``: the random states of the other processes, which it then holds too;
        ``optimizer_state``: the whole state of a sharded optimizer (by default the optimizer's own);
        ``sharded``, ``model_state``: under fsdp, the folder of the processes' shards, and the whole
        model's state dict (under save_only_model, or ``whole_model``: model/ beside the shards);
        ``in_flight``: under async_generation, each process's rounds sampled ahead (``AsyncGeneration.held``).
        Under save_only_model: the model alone."""
        state = {**dataclasses.asdict(self.progress), "history": self.history, "before": self.before,
                 "sampler": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "unlogged_metrics": self.unlogged_metrics, "processes": self.world.size}
        whole = not self.args.save_only_model
        with tokenizer_as_loaded(self.tokenizer) as tokenizer:
            return save_checkpoint(self.run_dir, self.global_step, self.model,
                                   (optimizer_state or self.optimizer.state_dict()) if whole and sharded is None
                                   else None, state, self._moving_reference(), self.args.save_total_limit,
                                   tokenizer, other_processes_rng, sharded, model_state, whole_model, in_flight)

    def _restore(self, path: Path) -> None:
        try:
            state = load_checkpoint(path, self.model, self.optimizer, self._moving_reference(), self.world.rank,
                                    self.parts.policy_pass, self.parts.reference_pass)
            self.scheduler.load_state_dict(state["scheduler"])
            self.sampler.load_state_dict(state["sampler"])
            # a field an older checkpoint lacks keeps its start value
            saved = {f.name: state[f.name] for f in dataclasses.fields(Progress) if f.name in state}
            self.progress = dataclasses.replace(self.progress, **saved)
            if not self.args.use_adaptive_entropy:  # a fixed coefficient is this run's config, as the learning rate
                self.progress = dataclasses.replace(self.progress, entropy_coef=self.args.entropy_coef)
            self.history, self.before = state["history"], state["before"]
            self.unlogged_metrics = state.get("unlogged_metrics", [])  # older checkpoints do not carry it
            in_flight_file = path / IN_FLIGHT  # async_generation: each process's rounds sampled ahead
            in_flight = torch.load(in_flight_file, weights_only=False) if in_flight_file.is_file() else None
            saved_processes = state.get("processes", 1)
        except CheckpointError:
            raise
        except Exception as e:  # a damaged checkpoint, or one a different setup wrote
            raise CheckpointError(f"could not resume from {path}: {type(e).__name__}: {e}. It is damaged or was "
                                  "written by a different setup (model, LoRA settings); resume from an earlier "
                                  "checkpoint or start a new run") from None
        if in_flight is not None and len(in_flight) != self.world.size and self.args.async_generation:
            raise CheckpointError(f"{path} holds the rounds {len(in_flight)} process(es) sampled ahead under "
                                  f"async_generation, each its share of the prompts, and this run has {self.world.size}: "
                                  f"resume with {len(in_flight)} process(es), or from a checkpoint of a synchronous run")
        self.in_flight = None if in_flight is None or len(in_flight) != self.world.size else in_flight[self.world.rank]
        if in_flight is not None and not self.args.async_generation:
            warnings.warn(f"{path} holds {len(in_flight[0]['rounds'])} round(s) sampled ahead under "
                          "async_generation, which this run (async_generation: false) does not train: the run does "
                          "not continue as it would have; resume with async_generation: true for that", stacklevel=3)
        if saved_processes != self.world.size:
            warnings.warn(f"{path} was written by a run of {saved_processes} process(es) and this one has "
                          f"{self.world.size}: each optimizer step now takes the prompts of {self.world.size}, so "
                          "the run does not continue as it would have", stacklevel=3)
        if any(i >= len(self.parts.prompts.rows) for i in self.sampler.order):
            raise CheckpointError(f"{path} was written while training on a larger dataset than this run's "
                                  f"{len(self.parts.prompts.rows)} rows; resume with the same dataset")
        # the learning rate is this run's config too (max_steps and the schedule already are)
        self.scheduler.base_lrs = [self.args.learning_rate for _ in self.scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.args.learning_rate
            group["lr"] = self.args.learning_rate * setup.lr_schedule(self.args)(self.scheduler.last_epoch)

    def _moving_reference(self) -> torch.nn.Module | None:
        """The reference model when sync_ref_model moves it (then a checkpoint must carry it), else None."""
        return self.reference.frozen if self.reference is not None and self.args.sync_ref_model else None

    def _save_config(self) -> None:
        """config.yaml of the run (``config_as_used``); a resume whose settings differ from the last
        saved ones writes config.resumed-at-N.yaml beside them."""
        path, now = self.run_dir / "config.yaml", self.config_as_used
        if path.exists() and self.resume_from is not None:
            latest = latest_run_config(self.run_dir)
            saved = yaml.safe_load(latest.read_text()) or {}
            if ({k: v for k, v in saved.items() if k not in RESUME_FIELDS}
                    == {k: v for k, v in now.items() if k not in RESUME_FIELDS}):
                return
            path = self.run_dir / f"config.resumed-at-{self.global_step}.yaml"
        write_run_config(path, now)

    @contextlib.contextmanager
    def _stop_on_signals(self, log: RunLog):
        """SIGINT / SIGTERM: finish the current step, save a checkpoint, stop. A second one stops at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum, frame):
            if self.stop_signal is not None:
                raise KeyboardInterrupt
            self.stop_signal = signum
            log.info(f"[yellow]{signal.Signals(signum).name} received: saving a checkpoint after this step "
                     "(send it again to stop at once, without saving)[/]")
            if self.world.size > 1:
                log.info("[yellow]a signal sent to torchrun reaches the processes, but torchrun kills them "
                         "30 s later unless started with a longer --shutdown-timeout[/]")

        previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    # ---- the run's outputs ------------------------------------------------------------------

    def _save_final_model(self) -> Path:
        """final_model/, whole or not at all (written beside it, then renamed into place). When it cannot
        be written (a full disk), a checkpoint is tried, so that the trained weights are not lost."""
        final = self.run_dir / "final_model"

        try:
            return self._write_model(final)
        except Exception as e:  # OSError, or safetensors' own error type for a full disk (in every process)
            try:
                saved = self._checkpoint_every_process()
                kept = (f"the trained weights are in {saved / 'model'}" if self.args.save_only_model else
                        f"the trained weights are in {saved}; free space, then finish the run with --output-dir "
                        f"{self.run_dir} --resume-from-checkpoint auto")
            except CheckpointError:
                kept = "a checkpoint could not be written either"
            raise CheckpointError(f"could not write the final model to {final}: {getattr(e, 'strerror', None) or e} "
                                  f"({type(e).__name__}); {kept}") from e

    def _write_outputs(self, final: Path, before: dict | None, after: dict | None, history: list[dict]) -> dict:
        """summary.json in the run folder and the model card beside the final model; the summary."""
        summary = {
            "steps": self.global_step,
            "model": self.model_name,
            "dataset": self.dataset_name,
            "processes": self.world.size,
            "prompts_over_max_prompt_length": self.prompt_overflow_count,
            "final_model": str(final),
            "before": _without_samples(before),
            "after": _without_samples(after),
            "final_metrics": history[-1] if history else None,
        }
        if before and after:
            summary["accuracy_change"] = accuracy_change(before, after)
            summary["eval_samples"] = {"before": before["samples"][:8], "after": after["samples"][:8]}
        write_json(self.run_dir / "summary.json", summary)
        adapter = is_peft_model(self.model)
        hyperparameters = {k: self.config_as_used[k] for k in MODEL_CARD_FIELDS}  # as the run used them
        hyperparameters["use_peft"] = adapter
        base = self.model_name
        if adapter:  # the adapter's own settings (those of a saved adapter trained further too)
            lora = self.model.peft_config[self.model.active_adapter]
            targets = lora.target_modules
            hyperparameters.update(lora_r=lora.r, lora_alpha=lora.lora_alpha, lora_target_modules=sorted(targets)
                                   if isinstance(targets, (set, list)) else targets)
            if (Path(base) / "adapter_config.json").is_file():  # training went on from a saved adapter
                base = lora.base_model_name_or_path or base
        (final / "README.md").write_text(model_card(
            base, self.dataset_name, self.parts.rewards.names, self.parts.rewards.weights,
            hyperparameters, self.global_step, before, after, adapter=adapter))
        return summary


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in (before, after]."""
    return after // every > before // every


def _without_samples(result: dict | None) -> dict | None:
    return None if result is None else {k: v for k, v in result.items() if k != "samples"}


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
