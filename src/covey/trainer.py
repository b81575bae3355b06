"""The GRPO trainer: set-up, then one step at a time in the order of the algorithm.

    for each step:
        generate    G completions per prompt with the rollout engine
        score       every reward function, combined with reward_weights
        advantage   group-relative, per prompt
        log-probs   old (only when reused over several iterations) and reference (only when beta > 0)
        loss, step  clipped surrogate over micro-batches, gradient clipping, AdamW, schedule

Groups stay whole inside one generation batch. Under several processes (``covey.distributed``)
each samples and trains on groups of its own prompts; rewards are gathered before the advantage,
loss counts and gradients summed over the processes, and the first process records the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from covey import core
from covey.answers import completion_text
from covey.checkpoint import load_checkpoint, resolve_checkpoint, rng_states, save_checkpoint, saved_step, written_whole
from covey.config import RESUME_FIELDS, SYNC_WITH_LORA, GRPOConfig
from covey.errors import CheckpointError, ConfigError, DataError, NumericsError, TrainingInterrupted
from covey.distributed import World, sharded_part
from covey.data import (PromptSampler, check_reward_columns, extra_columns, heldout_rows, is_conversational,
                        load_rows, shared_prompts)
from covey.evaluation import accuracy_change, evaluate, merge_evaluations, percent
from covey.logprobs import SequenceBatch, completion_logprobs
from covey.models import (Reference, adapted_shared_matrix, add_lora, autocast, disable_dropout, eos_token_ids,
                          is_peft_model, keep_freed_memory, load_policy, load_tokenizer, prepare_tokenizer,
                          tokenizer_as_loaded)
from covey.reward_pool import RewardPool
from covey.rewards import (RewardFunc, TrainerState, load_reward_func, preflight_check, reward_context, reward_name,
                           score_completions)
from covey.rollout import Rollout, RolloutEngine, SamplingParams, left_pad, make_engine
from covey.run_folder import claim_run_dir, config_as_used, latest_run_config, make_run_dir, write_run_config
from covey.server import ServerEngine
from covey.telemetry import RunLog, model_card, print_summary, write_json
from covey.trackers import check_trackers, make_trackers
from covey.vllm_engine import check_vllm_installed
from covey.text import decode_completions, encode_prompts


@dataclasses.dataclass
class GenerationBatch:
    """Everything one generation round produced, ready for the optimisation passes."""

    sequences: SequenceBatch
    loss_mask_BT: torch.Tensor  # (B, T) completion tokens that enter the loss
    sampling_logp_BT: torch.Tensor  # (B, T) log-probs under the engine's sampling distribution
    rewards_BF: torch.Tensor  # (B, F) per reward function, NaN = None
    finish_reasons: list[str]
    records: list[dict]  # prompt / completion / rewards per row, for completions.jsonl
    advantages_B: torch.Tensor | None = None  # (B,)
    zero_std_N: torch.Tensor | None = None  # (N,) groups whose rewards were all equal
    old_logp_BT: torch.Tensor | None = None  # None: the policy has not moved since generation (ratio is 1)
    ref_logp_BT: torch.Tensor | None = None  # None when beta == 0
    engine_weights: torch.Tensor | None = None  # engine/trainer importance weights, (B, T) or (B, 1)
    engine_weights_pending: bool = False  # True: filled in by the training forward (see generate_and_score)

    def select(self, rows: list[int]) -> "GenerationBatch":
        """The given rows (before advantages and log-probs are attached)."""
        index = torch.tensor(rows, dtype=torch.long)
        seq = self.sequences
        return GenerationBatch(
            SequenceBatch(seq.prompt_ids_BP[index], seq.prompt_mask_BP[index], seq.completion_ids_BT[index],
                          seq.completion_mask_BT[index]),
            self.loss_mask_BT[index], self.sampling_logp_BT[index], self.rewards_BF[index],
            [self.finish_reasons[i] for i in rows], [self.records[i] for i in rows])

    @staticmethod
    def concat(batches: list["GenerationBatch"], pad_token_id: int) -> "GenerationBatch":
        """The rows of ``batches`` in order, padded to common widths."""
        if len(batches) == 1:
            return batches[0]
        P = max(b.sequences.prompt_ids_BP.shape[1] for b in batches)
        T = max(b.sequences.completion_ids_BT.shape[1] for b in batches)

        def left(x, width, value):
            return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

        def right(x, width, value):
            return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

        cat = torch.cat

        def cat_if_all(parts):  # what batches carry once advantages are attached (gathered from processes)
            return cat(parts) if all(p is not None for p in parts) else None

        return GenerationBatch(
            SequenceBatch(cat([left(b.sequences.prompt_ids_BP, P, pad_token_id) for b in batches]),
                          cat([left(b.sequences.prompt_mask_BP, P, 0) for b in batches]),
                          cat([right(b.sequences.completion_ids_BT, T, pad_token_id) for b in batches]),
                          cat([right(b.sequences.completion_mask_BT, T, 0) for b in batches])),
            cat([right(b.loss_mask_BT, T, 0) for b in batches]),
            cat([right(b.sampling_logp_BT, T, 0.0) for b in batches]),
            cat([b.rewards_BF for b in batches]),
            [r for b in batches for r in b.finish_reasons], [r for b in batches for r in b.records],
            advantages_B=cat_if_all([b.advantages_B for b in batches]),
            zero_std_N=cat_if_all([b.zero_std_N for b in batches]))


def builtin_reward_settings(args: GRPOConfig) -> dict[str, dict]:
    """Keyword arguments of the built-in rewards that take settings, from the config."""
    overlong_max = args.overlong_max_length or args.max_completion_length
    return {"soft_overlong_penalty": {"max_length": overlong_max,
                                      "cache_length": args.overlong_cache_length or max(1, overlong_max // 4)},
            "code_tests": {"timeout": args.code_timeout, "memory_limit_mb": args.code_memory_limit_mb}}


def load_rewards(args: GRPOConfig, reward_funcs: Sequence[RewardFunc | str] | None = None
                 ) -> tuple[list[RewardFunc], list[float]]:
    """The reward functions (given, else ``args.reward_funcs``) and their weights (default: all 1.0)."""
    funcs = [load_reward_func(f, builtin_reward_settings(args)) for f in (reward_funcs or args.reward_funcs)]
    names = [reward_name(f) for f in funcs]
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise ConfigError(f"two reward functions are both named {repeated[0]!r}: their metrics and recorded rewards "
                          "would overwrite each other; give each its own name (a def of its own, or set __name__)")
    weights = args.reward_weights or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions; "
                          "give one weight per function")
    return funcs, weights


def one_batch_settings(args: GRPOConfig, num_prompts: int, **changes: Any) -> GRPOConfig:
    """``args`` for sampling and scoring one batch of ``num_prompts`` prompts without training: nothing
    is written (no run folder unless train() runs, no evaluation). A length in epochs becomes one step."""
    if args.max_steps == -1:
        changes = {"max_steps": 1, "num_train_epochs": None, **changes}
    return dataclasses.replace(args, output_dir=None, resume_from_checkpoint=None, eval_max_samples=0,
                               gradient_accumulation_steps=1, per_device_train_batch_size=num_prompts * args.num_generations,
                               steps_per_generation=None, **changes)


class GRPOTrainer:
    """Train ``model`` with GRPO on ``train_dataset`` scored by ``reward_funcs``.

        trainer = GRPOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=[my_reward],
                              args=GRPOConfig(max_steps=50), train_dataset=rows)
        trainer.train()

    ``model``: hub id, folder or loaded model (default: ``args.model``). ``reward_funcs``: callables or
    names (default: ``args.reward_funcs``). ``train_dataset``: rows, a ``datasets.Dataset`` or a dataset
    spec (default: ``args.dataset``). Everything is checked before any model is loaded.
    """

    def __init__(self, model: Any = None, reward_funcs: Sequence[RewardFunc | str] | RewardFunc | None = None,
                 args: GRPOConfig | None = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, peft_config: Any = None, rollout_engine: RolloutEngine | None = None,
                 quiet: bool = False):
        self.args = args = args or GRPOConfig()
        if ((processes := World.launched_size()) > 1 and rollout_engine is None and args.rollout_engine == "vllm"
                and args.vllm_mode == "colocate"):
            raise ConfigError(f"rollout_engine: vllm with vllm_mode: colocate runs in a single process, and this run "
                              f"has {processes} (WORLD_SIZE); with several processes use vllm_mode: server (one "
                              "`covey server` for all of them) or rollout_engine: fast, or train in one process")
        self.world = World.from_environment()
        if callable(reward_funcs) or isinstance(reward_funcs, str):
            reward_funcs = [reward_funcs]
        self.reward_funcs, self.reward_weights = load_rewards(args, reward_funcs)
        self.config_as_used = config_as_used(args, model, train_dataset, eval_dataset, reward_funcs, peft_config)
        self.reward_pool = RewardPool(self.reward_funcs, args.reward_num_workers, args.num_generations)  # starts on first use
        self.reward_weights_F = torch.tensor(self.reward_weights, dtype=torch.float64)
        self._load_rows(train_dataset, eval_dataset)
        check_trackers(args.report_to)
        if rollout_engine is None and args.rollout_engine == "vllm" and args.vllm_mode == "colocate":
            check_vllm_installed()
        if args.sync_ref_model and (peft_config is not None or is_peft_model(model)):
            raise ConfigError(SYNC_WITH_LORA)
        self.resume_from = (resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
                            if args.resume_from_checkpoint else None)
        if args.max_steps != -1:
            self._check_resumed_step()
        self.run_dir = self.world.on_main(lambda: make_run_dir(args, self.resume_from))
        torch.manual_seed(self.world.seed(args.seed))  # dropout masks of its own in each process

        if processing_class is not None:
            self.tokenizer = processing_class
            prepare_tokenizer(self.tokenizer)
        else:
            source = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
            self.tokenizer = load_tokenizer(source or args.model, args.trust_remote_code)
        self._encode_train_prompts()
        if args.max_steps == -1:  # num_train_epochs passes over the prompts kept, as a number of steps from here on
            self.args = args = dataclasses.replace(
                args, max_steps=args.steps_for_epochs(len(self.train_rows), self.world.size), num_train_epochs=None)
            self._check_resumed_step()

        self.model = self._build_policy(model, peft_config)
        self.world.check_device(next(self.model.parameters()).device)
        self.world.broadcast_parameters(self.model)
        if args.sync_ref_model and is_peft_model(self.model):  # a folder that held a LoRA adapter
            raise ConfigError(SYNC_WITH_LORA)
        if model is None or isinstance(model, str):
            self.model_name = model or args.model
        else:
            self.model_name = getattr(getattr(model, "config", None), "_name_or_path", None) or "a model object"
        self.reference = Reference(self.model) if args.beta > 0 else None
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.engine = rollout_engine or make_engine(args.rollout_engine, self.model, self.tokenizer, self.eos_ids,
                                                    args=args)
        # several processes sharing one rollout server: the first pushes the policy (_push_policy_from_main)
        self.shared_server = self.world.size > 1 and isinstance(self.engine, ServerEngine)
        self.server_stale = self.shared_server  # the server does not hold the current policy yet
        if self.shared_server:
            self.engine.pushes = self.world.is_main
        self.device = next(self.model.parameters()).device
        self.optimizer = self._make_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        # the prompts of every process, drawn together; each takes its share (World.share)
        self.sampler = PromptSampler(len(self.train_rows), args.prompts_per_round(self.world.size), args.seed)
        self.loss_settings = core.LossSettings(
            loss_type=args.loss_type, epsilon_low=args.epsilon,
            epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high, delta=args.delta,
            clip_ratio_c=args.clip_ratio_c, importance_sampling_level=args.importance_sampling_level, beta=args.beta,
            kl_estimator=args.kl_estimator, use_bias_correction_kl=args.use_bias_correction_kl,
            top_entropy_quantile=args.top_entropy_quantile)
        self.quiet = quiet or not self.world.is_main
        self.global_step = 0
        self.rounds_sampled = 0
        self.bad_steps = self.consecutive_bad_steps = 0
        self.reward_errors, self.warned_reward_errors = 0, False
        self.round_reward_errors = 0
        self.dynamic_sampling_stats: dict[str, float] = {}
        self.reward_metrics: dict[str, list[float]] = {}
        self.before: dict | None = None  # the evaluation before training
        self.history: list[dict] = []  # logged metrics, restored on resume
        self.unlogged_metrics: list[dict] = []  # the steps since the last logged one (averaged into the next)
        self.stop_signal: int | None = None  # SIGINT/SIGTERM received: checkpoint and stop after this round
        if self.resume_from is not None:
            self._restore(self.resume_from)

    def _check_resumed_step(self) -> None:
        if self.resume_from is not None and (resumed_at := saved_step(self.resume_from)) > self.args.max_steps:
            raise ConfigError(f"{self.resume_from} is at step {resumed_at}, beyond max_steps="
                              f"{self.args.max_steps}: raise max_steps to continue the run, or resume from an earlier "
                              "checkpoint")

    def _load_rows(self, train_dataset: Any, eval_dataset: Any) -> None:
        """The training and held-out rows, checked against what the reward functions need."""
        args, reward_funcs = self.args, self.reward_funcs
        dataset = train_dataset if train_dataset is not None else args.dataset
        self.dataset_name = dataset if isinstance(dataset, str) else "an in-memory dataset"
        self.train_rows = load_rows(dataset, split=args.dataset_split)
        check_reward_columns(self.train_rows, reward_funcs, self.dataset_name)
        # the length of a run in epochs is known once prompts too long are dropped; this call sees an estimate
        steps = args.max_steps if args.max_steps != -1 else args.steps_for_epochs(len(self.train_rows), self.world.size)
        preflight_check(reward_funcs, [r["prompt"] for r in self.train_rows[:2]], extra_columns(self.train_rows[:2]),
                        steps)
        self.eval_rows = heldout_rows(dataset, eval_dataset if eval_dataset is not None else args.eval_dataset,
                                      args.eval_max_samples, args.eval_split)
        if self.eval_rows and (shared := shared_prompts(self.train_rows, self.eval_rows)):
            warnings.warn(f"{shared} of the {len(self.eval_rows)} held-out prompts are training prompts too, so the "
                          "before/after accuracy is not held-out; give eval_dataset (or eval_split) data the run does "
                          "not train on", stacklevel=3)
        if self.eval_rows:
            check_reward_columns(self.eval_rows, reward_funcs, "eval_dataset")

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters; under shard_optimizer_state with several processes, each
        process keeps the state of (and updates) a share of them, and sends its updated share to the others."""
        args = self.args
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        # the fused kernel updates each tensor in one pass over its memory (the same numbers, a quarter of the time)
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in trainable)
        settings = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                        weight_decay=args.weight_decay, fused=fused or None)
        if args.shard_optimizer_state and self.world.size > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            if len(kinds := {(p.dtype, p.device) for p in trainable}) > 1:
                raise ConfigError(f"shard_optimizer_state needs every trained parameter in one dtype on one device; "
                                  f"this model's are {sorted(map(str, kinds))}: cast the model to one dtype, or turn "
                                  "shard_optimizer_state off")
            return ZeroRedundancyOptimizer(trainable, optimizer_class=torch.optim.AdamW, **settings)
        return torch.optim.AdamW(trainable, **settings)

    def _encode_train_prompts(self) -> None:
        """Token ids of every training prompt; rows over max_prompt_length follow prompt_overflow."""
        args, overflowed = self.args, []
        prompt_ids = encode_prompts(self.tokenizer, [r["prompt"] for r in self.train_rows], args.max_prompt_length,
                                    self.dataset_name, args.prompt_overflow, overflowed)
        kept = [i for i, ids in enumerate(prompt_ids) if ids is not None]
        if not kept:
            raise DataError(f"every training prompt is longer than max_prompt_length={args.max_prompt_length}")
        self.train_rows, self.prompt_ids = [self.train_rows[i] for i in kept], [prompt_ids[i] for i in kept]
        self.prompt_overflow_count = len(overflowed)
        if overflowed:
            action = "dropped" if args.prompt_overflow == "drop" else "cut to their last tokens"
            warnings.warn(f"{len(overflowed)} training prompts were longer than max_prompt_length="
                          f"{args.max_prompt_length} and were {action} (first: row {overflowed[0]})", stacklevel=3)

    def _build_policy(self, model: Any, peft_config: Any) -> torch.nn.Module:
        """The model to train: loaded if given by name, wrapped in LoRA when asked."""
        args = self.args
        policy = model if isinstance(model, torch.nn.Module) else load_policy(model or args.model, args.trust_remote_code)
        if (args.use_peft or peft_config is not None) and not is_peft_model(policy):
            if peft_config is not None:
                from peft import get_peft_model

                policy = get_peft_model(policy, peft_config)
            else:
                policy = add_lora(policy, args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
        if shared := adapted_shared_matrix(policy):
            warnings.warn(f"the LoRA adapter on {shared} changes a matrix the input embedding and the output head "
                          "share: the adapter trains and saves exactly, and covey export gives a model with the two "
                          "untied, but peft's merge_and_unload changes both, and vLLM or a covey server (which hold "
                          f"them tied) cannot sample with it; leave {shared.rpartition('.')[2]} out of "
                          "lora_target_modules to avoid both", stacklevel=3)
        if args.disable_dropout:
            disable_dropout(policy)
        if args.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        return policy

    def _lr_factor(self, step: int) -> float:
        """Linear warmup (warmup_steps or warmup_ratio), then the chosen decay."""
        warmup = self.args.warmup_optimizer_steps
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, self.args.max_steps - warmup)
        return {"constant": 1.0, "linear": 1.0 - progress,
                "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[self.args.lr_scheduler_type]

    # ---- the loop ---------------------------------------------------------------------------

    def train(self) -> dict:
        """Run max_steps optimizer steps; returns the summary that is also written to summary.json."""
        args = self.args
        if args.keep_freed_memory:
            keep_freed_memory()
        self.run_dir = self.world.on_main(self._open_run_dir)
        trackers = make_trackers(args.report_to, self.run_dir, args.run_name or self.run_dir.name, self.config_as_used,
                                 first_step=self.global_step + 1) if self.world.is_main else []
        with (self.reward_pool, RunLog(self.run_dir, args.max_steps, quiet=self.quiet, trackers=trackers,
                                       record=self.world.is_main) as log,
              self._stop_on_signals(log)):
            if self.resume_from is not None:
                log.resume(self.history, self.global_step)
                log.info(f"resumed from {self.resume_from} at step {self.global_step}")
            elif self.eval_rows:
                self.before = self.evaluate()
                log.info(f"held-out accuracy before training: {percent(self.before['accuracy'])} "
                         f"(mean reward {self.before['mean_reward']:.3f}, n={self.before['n']})")
            while self.global_step < args.max_steps:
                self._generation_round(log)
            final = self._save_final_model()  # before anything else can fail
            after = self.evaluate() if self.eval_rows else None
        summary = self.world.on_main(lambda: self._write_outputs(final, self.before, after, log.history))
        if not self.quiet:
            print_summary(log.console, self.before, after, self.run_dir)
        return summary

    def _open_run_dir(self) -> Path:
        """The run folder, taken for this run (or reopened to resume it), with the run's config saved."""
        if self.resume_from is None:
            self.run_dir = claim_run_dir(self.run_dir, self.args)
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._save_config()
        return self.run_dir

    def _generation_round(self, log: RunLog) -> None:
        """One generation batch, then its optimizer steps: (micro-batches per generation /
        gradient_accumulation_steps) windows, each visited num_iterations times."""
        args = self.args
        round_start = start = time.perf_counter()
        first_step = self.global_step
        self._push_policy_from_main()
        batch, timings = self.generate_and_score()
        whole = self._whole_batch(batch)  # of every process, for the metrics and completions.jsonl
        window = args.per_device_train_batch_size * args.gradient_accumulation_steps
        B = batch.loss_mask_BT.shape[0]
        # as many optimizer steps in every process (one whose batch came out smaller takes part without rows)
        windows = self.world.max(math.ceil(B / window))
        for iteration in range(args.num_iterations):
            for first in range(0, windows * window, window):
                if self.global_step >= args.max_steps:
                    break
                t_train = time.perf_counter()
                # until the first optimizer step on this batch the policy *is* the old policy: ratio exactly 1
                policy_unchanged = iteration == 0 and first == 0
                stats = self.optimize(batch, slice(min(first, B), min(first + window, B)), policy_unchanged)
                self.global_step += 1
                if hasattr(self.engine, "policy_changed"):  # an engine with its own copy of the weights (vLLM)
                    self.engine.policy_changed(self.model)
                if self.reference is not None and args.sync_ref_model and self.global_step % args.ref_model_sync_steps == 0:
                    self.reference.sync(args.ref_model_mixup_alpha)
                timings["time/train"] = time.perf_counter() - t_train
                step_time, start = time.perf_counter() - start, time.perf_counter()
                if whole is not None:
                    self.unlogged_metrics.append(self._metrics(whole, stats, timings, step_time,
                                                               time.perf_counter() - round_start))
                if self.global_step % args.logging_steps == 0 or self.global_step == args.max_steps:
                    log.log_metrics(self.global_step, _interval_mean(self.unlogged_metrics))
                    self.unlogged_metrics = []
                timings = {"time/generate": 0.0, "time/score": 0.0}
        self.history = log.history
        self.server_stale = self.shared_server
        self._end_round(log, first_step, whole.records if whole is not None else [])

    def _push_policy_from_main(self) -> None:
        """Several processes sharing one rollout server, before they sample: the first pushes the policy
        if it changed since its last push, and the others learn which server instance holds it."""
        if not self.server_stale:
            return

        def push() -> str | None:
            self.engine.sync_weights(self.model)
            return self.engine.pushed_to

        self.engine.pushed_to = self.world.on_main(push)
        self.server_stale = False

    def _end_round(self, log: RunLog, first_step: int, records: list[dict]) -> None:
        """After a round's optimizer steps: record its completions when due, then checkpoint when due or
        asked to stop. Checkpoints fall between rounds, where the state is small and complete."""
        args, step = self.args, self.global_step
        if args.log_completions and (first_step == 0 or step == args.max_steps
                                     or _crossed(first_step, step, args.log_completions_steps)):
            log.log_completions(step, records, args.num_completions_to_print)
        # a signal to any process stops them all; one in the last step: just finish
        stop_signal = next((s for s in self.world.gather(self.stop_signal) if s is not None), None)
        stopping = stop_signal is not None and step < args.max_steps
        if not (args.save_steps and _crossed(first_step, step, args.save_steps) or stopping):
            return
        path = self._checkpoint_every_process()
        log.info(f"checkpoint saved: {path}")
        if stopping:
            raise TrainingInterrupted(
                f"stopped by {signal.Signals(stop_signal).name} at step {step}; checkpoint saved in {path}. "
                f"Continue with: covey train CONFIG --output-dir {self.run_dir} --resume-from-checkpoint auto",
                stop_signal)

    def generate_and_score(self, indices: list[int] | None = None) -> tuple[GenerationBatch, dict[str, float]]:
        """Steps 1-4 of the loop for the next prompts (or the training rows at ``indices``)."""
        args, G = self.args, self.args.num_generations
        timings = {"time/generate": 0.0, "time/score": 0.0}
        self.reward_metrics = {}  # what reward functions log with log_metric this round
        self.round_reward_errors = 0  # reward calls that failed this round (under reward_errors: skip)
        # 1-2. generate and score; under dynamic sampling, keep only groups with a reward spread
        batch = self._sample_and_score(indices if indices is not None else self._next_prompts(), timings)
        self.dynamic_sampling_stats = {}
        if args.dynamic_sampling and indices is None:
            batch = self._refill(batch, timings)
        # 3. advantages, over the rewards of every process
        rewards_per_process, new_errors = zip(*self.world.gather((batch.rewards_BF, self.round_reward_errors)))
        self.reward_errors += sum(new_errors)
        advantages_B, zero_std_N = core.advantages_from_rewards(
            torch.cat(rewards_per_process), self.reward_weights_F, G, args.scale_rewards,
            args.multi_objective_aggregation)
        first = sum(len(rewards) for rewards in rewards_per_process[:self.world.rank])  # this process's rows
        last = first + len(batch.rewards_BF)
        batch.advantages_B, batch.zero_std_N = advantages_B[first:last].float(), zero_std_N[first // G:last // G]
        for record, advantage in zip(batch.records, batch.advantages_B.tolist()):
            record["advantage"] = advantage
        # 4. log-probs of the policy that generated (only when it moves before its last use; else the
        #    training forward gives them) and of the reference (only when beta > 0)
        engine_mismatch = args.vllm_importance_sampling_correction and not getattr(self.engine, "exact_logprobs", True)
        policy_moves = args.num_iterations > 1 or args.micro_batches_per_generation > args.gradient_accumulation_steps
        if policy_moves:
            batch.old_logp_BT = self._logprobs_no_grad(self.model, batch.sequences)
            if engine_mismatch:
                batch.engine_weights = self._engine_weights(batch.old_logp_BT, batch.sampling_logp_BT,
                                                            batch.loss_mask_BT)
        elif engine_mismatch:
            # the policy that sampled is the one every micro-batch trains with: the training forward's
            # own log-probs give the weights, without a separate pass
            sequence_level = args.vllm_importance_sampling_mode.startswith("sequence")
            batch.engine_weights = torch.ones(len(batch.records), 1 if sequence_level else batch.loss_mask_BT.shape[1])
            batch.engine_weights_pending = True
        if self.reference is not None:
            with self.reference.model() as ref_model:
                batch.ref_logp_BT = self._logprobs_no_grad(ref_model, batch.sequences)
        return batch, timings

    def _whole_batch(self, batch: GenerationBatch) -> GenerationBatch | None:
        """The round's batch of every process in rank order, on the first process (None on the others),
        which also takes in what the reward functions logged and the dynamic-sampling counts of all."""
        if self.world.size == 1:
            return batch
        sent = dataclasses.replace(batch, old_logp_BT=None, ref_logp_BT=None, engine_weights=None)
        parts = self.world.gather_on_main((sent, self.reward_metrics, self.dynamic_sampling_stats))
        if parts is None:
            return None
        self.reward_metrics = {}
        for _, logged, _ in parts:
            for name, values in logged.items():
                self.reward_metrics.setdefault(name, []).extend(values)
        self.dynamic_sampling_stats = {  # every process runs the same number of extra rounds
            key: (max if key == "dynamic_sampling/extra_rounds" else sum)(stats[key] for _, _, stats in parts)
            for key in self.dynamic_sampling_stats}
        return GenerationBatch.concat([sent for sent, _, _ in parts], self.tokenizer.pad_token_id)

    def _next_prompts(self) -> list[int]:
        """The training rows of this process's next prompts."""
        return self.world.share(next(self.sampler))

    def _sample_and_score(self, indices: list[int], timings: dict[str, float]) -> GenerationBatch:
        args, G = self.args, self.args.num_generations
        t0 = time.perf_counter()
        prompt_ids = [self.prompt_ids[i] for i in indices]
        params = SamplingParams(args.max_completion_length, args.temperature, args.top_p, args.top_k, args.min_p or 0.0,
                                args.repetition_penalty, tuple(args.stop_strings or ()))
        rollout = self.engine.generate(prompt_ids, G, params, seed=self.world.seed(args.seed + self.rounds_sampled))
        self.rounds_sampled += 1
        t1 = time.perf_counter()
        rows = [self.train_rows[i] for i in indices for _ in range(G)]
        completions, completion_ids = decode_completions(self.tokenizer, rollout.completion_ids_BT,
                                                         rollout.completion_mask_BT, is_conversational(rows),
                                                         args.strip_reasoning)
        rewards_BF, logged_columns = self._score(rows, completions, completion_ids)
        timings["time/generate"] += t1 - t0
        timings["time/score"] += time.perf_counter() - t1
        loss_mask_BT = rollout.completion_mask_BT.clone()
        if args.mask_truncated_completions:
            truncated_B = torch.tensor([reason == "length" for reason in rollout.finish_reasons])
            loss_mask_BT[truncated_B] = 0
        totals_B = core.weighted_reward_sum(rewards_BF, self.reward_weights_F).tolist()
        records = [{"prompt": r["prompt"], "completion": completion_text(c), "answer": r.get("answer"),
                    "rewards": {reward_name(f): _none_if_nan(v) for f, v in zip(self.reward_funcs, rewards_BF[i].tolist())},
                    "reward": _none_if_nan(totals_B[i]), "finish_reason": rollout.finish_reasons[i]}
                   for i, (r, c) in enumerate(zip(rows, completions))]
        for i, record in enumerate(records):  # what reward functions logged with log_extra, beside (never over) them
            record.update({column: values[i] for column, values in logged_columns.items() if column not in record})
        return GenerationBatch(self._sequences(prompt_ids, rollout), loss_mask_BT, rollout.sampling_logp_BT,
                               rewards_BF, rollout.finish_reasons, records)

    def _score(self, rows: list[dict], completions: list, completion_ids: list) -> tuple[torch.Tensor, dict[str, list]]:
        """Step 2: every reward function on the batch, (B, F); and the columns they logged with
        ``log_extra`` (a value per completion). Failures under reward_errors: skip are counted."""
        args, errors, logged_columns = self.args, [], {}

        def log_extra(column: str, values: list) -> None:
            if len(values) != len(rows):
                raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {len(rows)} completions")
            logged_columns[str(column)] = [v.item() if callable(getattr(v, "item", None)) else v for v in values]

        context = reward_context(self.reward_state(), self._log_reward_metric, log_extra)
        rewards_BF = score_completions(self.reward_funcs, [r["prompt"] for r in rows], completions, completion_ids,
                                       extra_columns(rows), args.reward_errors, args.reward_timeout, errors,
                                       self.reward_pool, context)
        self.round_reward_errors += len(errors)
        if errors and not self.warned_reward_errors:
            self.warned_reward_errors = True
            name, index, reason = errors[0]
            where = "" if index is None else f" on completion {index}"
            warnings.warn(f"reward function {name!r} {reason}{where}; scored None where it failed "
                          "(reward_errors: skip). Shown once; the count is logged as rewards/errors.", stacklevel=3)
        return rewards_BF, logged_columns

    def _refill(self, batch: GenerationBatch, timings: dict[str, float]) -> GenerationBatch:
        """DAPO dynamic sampling: drop groups whose rewards are all equal (they carry no signal) and
        sample new prompts until the batch is full again or the round cap is reached."""
        G, wanted = self.args.num_generations, self.args.generation_batch_size // self.args.num_generations
        kept, n_kept, dropped, rounds = [], 0, 0, 0
        while True:
            if batch is not None:
                _, zero_std_N = core.group_advantages(core.weighted_reward_sum(batch.rewards_BF, self.reward_weights_F), G)
                groups = [g for g in range(len(zero_std_N)) if not zero_std_N[g]][: wanted - n_kept]
                dropped += int(zero_std_N.sum())
                if groups:
                    kept.append(batch.select([g * G + j for g in groups for j in range(G)]))
                    n_kept += len(groups)
            # every process draws its next prompts while any one needs more, so that they keep to one order
            if not self.world.any(n_kept < wanted) or rounds >= self.args.dynamic_sampling_max_rounds:
                break
            rounds += 1
            indices = self._next_prompts()
            if n_kept < wanted:
                batch = self._sample_and_score(indices, timings)
            else:  # this process has enough: its prompts of the round are passed over
                batch = None
                self.rounds_sampled += 1
        self.dynamic_sampling_stats = {"dynamic_sampling/dropped_groups": float(dropped),
                                       "dynamic_sampling/extra_rounds": float(rounds),
                                       "dynamic_sampling/kept_groups": float(n_kept)}
        if not kept:  # every group was constant: train on the last batch (all advantages are 0)
            return batch
        return GenerationBatch.concat(kept, self.tokenizer.pad_token_id)

    def reward_state(self) -> TrainerState:
        """What reward functions are told of training (``trainer_state``)."""
        return TrainerState(global_step=self.global_step, max_steps=self.args.max_steps, epoch=self.sampler.progress)

    def _log_reward_metric(self, name: str, value: float) -> None:
        """``log_metric`` of reward functions: values of this round, averaged into the step's metrics."""
        self.reward_metrics.setdefault(str(name), []).append(float(value))

    def optimize(self, batch: GenerationBatch, window: slice | None = None,
                 policy_unchanged: bool = True) -> dict[str, float]:
        """5-6. One optimizer step over the micro-batches of ``window`` (default: the whole batch).
        ``policy_unchanged``: no step was taken since generation, so old log-probs = current ones."""
        args = self.args
        self.model.train()
        B = batch.loss_mask_BT.shape[0]
        window = window or slice(0, B)
        rows_in_window = window.stop - window.start
        generation_tokens = float(batch.loss_mask_BT.sum())
        # the sizes of the optimizer step, over every process: each normalises by them, and the summed
        # gradients are those of the whole step
        step = self.world.sum({
            "sequences": rows_in_window,
            "tokens": generation_tokens * rows_in_window / B,  # the generation batch's tokens, per optimizer step
            "micro_batches": math.ceil(rows_in_window / args.per_device_train_batch_size)})
        counts = core.BatchCounts(int(step["sequences"]), step["tokens"], int(step["micro_batches"]),
                                  args.max_completion_length)
        totals: dict[str, float] = {"loss": 0.0}
        for start in range(window.start, window.stop, args.per_device_train_batch_size):
            rows = slice(start, min(start + args.per_device_train_batch_size, window.stop))
            micro = batch.sequences.rows(rows)
            T = micro.completion_ids_BT.shape[1]
            with autocast(self.device, args.bf16):
                logp_BT, entropy_BT = completion_logprobs(self.model, micro, args.temperature, with_entropy=True)
            reuse = batch.old_logp_BT is None or policy_unchanged
            old_BT = logp_BT.detach() if reuse else batch.old_logp_BT[rows, :T].to(self.device)
            ref_BT = None if batch.ref_logp_BT is None else batch.ref_logp_BT[rows, :T].to(self.device)
            if batch.engine_weights_pending:
                computed = self._engine_weights(old_BT, batch.sampling_logp_BT[rows, :T].to(self.device),
                                                batch.loss_mask_BT[rows, :T].to(self.device))
                batch.engine_weights[rows, :computed.shape[1]] = computed.cpu()
            weights = None if batch.engine_weights is None else batch.engine_weights[rows, :T].to(self.device)
            loss, stats = core.policy_loss(
                logp_BT, old_BT, batch.advantages_B[rows].to(self.device), batch.loss_mask_BT[rows, :T].to(self.device),
                counts, self.loss_settings, ref_BT, entropy_BT, weights)
            loss.backward()
            totals["loss"] += float(loss.detach())
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        if batch.engine_weights is not None:  # over the trained tokens (token level) or the sequences
            weights = batch.engine_weights
            counted = batch.loss_mask_BT.float() if weights.shape[1] > 1 else torch.ones_like(weights)
            totals.update(engine_weight_sum=float((weights * counted).sum()), engine_counted=float(counted.sum()),
                          engine_masked=float(((weights == 0) * counted).sum()))
        totals = self.world.sum(totals)
        totals["grad_norm"] = self.apply_gradients()
        return totals

    def _engine_weights(self, trainer_logp_BT: torch.Tensor, sampling_logp_BT: torch.Tensor,
                        mask_BT: torch.Tensor) -> torch.Tensor:
        args = self.args
        return core.engine_importance_weights(
            trainer_logp_BT, sampling_logp_BT, mask_BT.float(), args.vllm_importance_sampling_mode,
            args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_clip_min)

    def apply_gradients(self) -> float:
        """Clip the accumulated gradients, step the optimizer and the schedule; the gradient norm.
        Non-finite gradients skip the update (counted); too many in a row stop the run."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.world.sum_gradients(params)
        clip = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.consecutive_bad_steps = 0
        else:
            self.bad_steps += 1
            self.consecutive_bad_steps += 1
            if self.consecutive_bad_steps >= self.args.max_consecutive_bad_steps:
                raise NumericsError(
                    f"{self.consecutive_bad_steps} steps in a row had NaN/inf gradients (step {self.global_step + 1}); "
                    "lower the learning rate, check the rewards for NaN/inf, or try bf16: false")
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # ---- checkpoints ------------------------------------------------------------------------

    def _checkpoint_every_process(self) -> Path:
        """A checkpoint, written by the first process with what the others send it: their random states
        (each resumes its own streams) and their parts of a sharded optimizer state. Its path."""
        sharded = sharded_part(self.optimizer) is not None
        optimizer_state = self.world.gather_optimizer_state(self.optimizer) if sharded else None
        process_rngs = self.world.gather(rng_states())
        return self.world.on_main(lambda: self.save_checkpoint(process_rngs[1:], optimizer_state))

    def save_checkpoint(self, other_processes_rng: list = (), optimizer_state: dict | None = None) -> Path:
        """Write checkpoints/checkpoint-<step> (atomically) and prune old ones; its path.
        ``other_processes_rng``: the random states of the other processes, which it then holds too;
        ``optimizer_state``: the whole state of a sharded optimizer (by default the optimizer's own)."""
        state = {key: getattr(self, key) for key in RESUMED_ATTRIBUTES}
        state.update(sampler=self.sampler.state_dict(), scheduler=self.scheduler.state_dict(),
                     unlogged_metrics=self.unlogged_metrics, processes=self.world.size)
        with tokenizer_as_loaded(self.tokenizer) as tokenizer:
            return save_checkpoint(self.run_dir, self.global_step, self.model,
                                   optimizer_state or self.optimizer.state_dict(), state,
                                   self._moving_reference(), self.args.save_total_limit, tokenizer,
                                   other_processes_rng)

    def _restore(self, path: Path) -> None:
        try:
            state = load_checkpoint(path, self.model, self.optimizer, self._moving_reference(), self.world.rank)
            self.scheduler.load_state_dict(state["scheduler"])
            self.sampler.load_state_dict(state["sampler"])
            for key in RESUMED_ATTRIBUTES:
                setattr(self, key, state[key])
            self.unlogged_metrics = state.get("unlogged_metrics", [])  # older checkpoints do not carry it
            saved_processes = state.get("processes", 1)
        except CheckpointError:
            raise
        except Exception as e:  # a damaged checkpoint, or one a different setup wrote
            raise CheckpointError(f"could not resume from {path}: {type(e).__name__}: {e}. It is damaged or was "
                                  "written by a different setup (model, LoRA settings); resume from an earlier "
                                  "checkpoint or start a new run") from None
        if saved_processes != self.world.size:
            warnings.warn(f"{path} was written by a run of {saved_processes} process(es) and this one has "
                          f"{self.world.size}: each optimizer step now takes the prompts of {self.world.size}, so "
                          "the run does not continue as it would have", stacklevel=3)
        if any(i >= len(self.train_rows) for i in self.sampler.order):
            raise CheckpointError(f"{path} was written while training on a larger dataset than this run's "
                                  f"{len(self.train_rows)} rows; resume with the same dataset")
        # the learning rate is this run's config too (max_steps and the schedule already are)
        self.scheduler.base_lrs = [self.args.learning_rate for _ in self.scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.args.learning_rate
            group["lr"] = self.args.learning_rate * self._lr_factor(self.scheduler.last_epoch)

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
        """SIGINT / SIGTERM: finish the current round, save a checkpoint, stop. A second one stops at once."""
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

    # ---- helpers ----------------------------------------------------------------------------

    def _sequences(self, prompt_ids: list[list[int]], rollout: Rollout) -> SequenceBatch:
        repeated = [ids for ids in prompt_ids for _ in range(self.args.num_generations)]
        prompt_ids_BP, prompt_mask_BP = left_pad(repeated, self.tokenizer.pad_token_id)
        return SequenceBatch(prompt_ids_BP, prompt_mask_BP, rollout.completion_ids_BT, rollout.completion_mask_BT)

    @torch.no_grad()
    def _logprobs_no_grad(self, model: torch.nn.Module, sequences: SequenceBatch) -> torch.Tensor:
        """Full-batch log-probs (B, T) padded to the batch width, in micro-batches; in eval mode
        (no dropout), whatever mode the model was left in."""
        B, T = sequences.completion_ids_BT.shape
        out = torch.zeros(B, T)
        was_training = model.training
        model.eval()
        try:
            for start in range(0, B, self.args.per_device_train_batch_size):
                rows = slice(start, start + self.args.per_device_train_batch_size)
                micro = sequences.rows(rows)
                with autocast(self.device, self.args.bf16):
                    logp, _ = completion_logprobs(model, micro, self.args.temperature)
                out[rows, : logp.shape[1]] = logp.float().cpu()
        finally:
            model.train(was_training)
        return out

    def _metrics(self, batch: GenerationBatch, stats: dict[str, float], timings: dict[str, float],
                 step_time: float, round_time: float) -> dict[str, float]:
        """TRL's metric names, computed over the generation batch (and the step's loss stats);
        ``tokens_per_second``: the batch's completion tokens per second of its round so far (its
        generation and the optimizer steps on it up to this one)."""
        lengths_B = batch.sequences.completion_mask_BT.sum(1).float()
        tokens = max(stats["tokens"], 1.0)
        rewards_B = core.weighted_reward_sum(batch.rewards_BF, self.reward_weights_F)
        metrics = {
            "reward": float(rewards_B.nanmean()),
            "reward_std": float(core.nanstd(rewards_B)),  # NaN (logged as null) where no reward is defined
            "frac_reward_zero_std": float(batch.zero_std_N.float().mean()),
        }
        for j, func in enumerate(self.reward_funcs):
            column = batch.rewards_BF[:, j]
            metrics[f"rewards/{reward_name(func)}/mean"] = float(column.nanmean())
            metrics[f"rewards/{reward_name(func)}/std"] = float(core.nanstd(column))
        metrics.update({name: sum(values) / len(values) for name, values in self.reward_metrics.items()})
        if self.args.beta > 0:
            metrics["kl"] = stats["kl_sum"] / tokens
        if "engine_counted" in stats:
            n = max(stats["engine_counted"], 1.0)
            metrics["engine_is/mean_weight"] = stats["engine_weight_sum"] / n
            metrics["engine_is/masked_fraction"] = stats["engine_masked"] / n
        metrics.update({
            "loss": stats["loss"],
            "policy_loss": stats["policy_loss"],
            "entropy": stats["entropy_sum"] / tokens,
            "clip_ratio/low_mean": stats["clip_low_sum"] / tokens,
            "clip_ratio/high_mean": stats["clip_high_sum"] / tokens,
            "clip_ratio/region_mean": (stats["clip_low_sum"] + stats["clip_high_sum"]) / tokens,
            "completions/mean_length": float(lengths_B.mean()),
            "completions/min_length": float(lengths_B.min()),
            "completions/max_length": float(lengths_B.max()),
            "completions/clipped_ratio": sum(r == "length" for r in batch.finish_reasons) / len(batch.finish_reasons),
            "learning_rate": self.scheduler.get_last_lr()[0],
            "grad_norm": stats["grad_norm"],
            "bad_steps": float(self.bad_steps),
            "rewards/errors": float(self.reward_errors),
            "step_time": step_time,
            **timings,
            **self.dynamic_sampling_stats,
            "tokens_per_second": float(lengths_B.sum()) / round_time,
        })
        return metrics

    def evaluate(self, rows: list[dict] | None = None) -> dict:
        """Greedy accuracy and mean reward on held-out rows (default: the configured eval split)."""
        rows = rows if rows is not None else self.eval_rows
        if not rows:
            raise ConfigError("no held-out data to evaluate on: set eval_dataset")
        self._push_policy_from_main()
        # every process evaluates its share of the rows
        parts = self.world.gather(evaluate(self.engine, self.tokenizer, self.world.share(rows), self.reward_funcs,
                                           self.reward_weights, self.args, self.reward_pool,
                                           reward_context(self.reward_state())))
        return merge_evaluations(parts)

    def _save_final_model(self) -> Path:
        """final_model/, whole or not at all (written beside it, then renamed into place). When it cannot
        be written (a full disk), a checkpoint is tried, so that the trained weights are not lost."""
        final = self.run_dir / "final_model"

        def write() -> Path:
            with written_whole(final, "final_model-*") as tmp:
                self.model.save_pretrained(tmp, safe_serialization=True)
                with tokenizer_as_loaded(self.tokenizer) as tokenizer:
                    tokenizer.save_pretrained(tmp)
            return final

        try:
            return self.world.on_main(write)
        except Exception as e:  # OSError, or safetensors' own error type for a full disk (in every process)
            try:
                kept = (f"the trained weights are in {self._checkpoint_every_process()}; free space, then "
                        f"finish the run with --output-dir {self.run_dir} --resume-from-checkpoint auto")
            except CheckpointError:
                kept = "a checkpoint could not be written either"
            raise CheckpointError(f"could not write the final model to {final}: {getattr(e, 'strerror', None) or e} "
                                  f"({type(e).__name__}); {kept}") from e

    def _write_outputs(self, final: Path, before: dict | None, after: dict | None, history: list[dict]) -> dict:
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
            base, self.dataset_name, [reward_name(f) for f in self.reward_funcs], self.reward_weights,
            hyperparameters, self.global_step, before, after, adapter=adapter))
        return summary


# the trainer's own state a checkpoint carries (besides model, optimizer, scheduler, data position, RNGs)
RESUMED_ATTRIBUTES = ("global_step", "rounds_sampled", "bad_steps", "consecutive_bad_steps", "reward_errors",
                      "warned_reward_errors", "history", "before")
# metrics that are a state or a running count: the last value of a logging interval, not its mean
LAST_OF_INTERVAL = ("learning_rate", "bad_steps", "rewards/errors")


def _interval_mean(steps: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of the steps since the last logged one, as TRL logs them: each the mean of its
    finite values over those steps (NaN where it had none), but state and counts as of the last."""
    merged = {}
    for key in dict.fromkeys(k for step in steps for k in step):
        values = [step[key] for step in steps if key in step]
        finite = [v for v in values if math.isfinite(v)]
        merged[key] = values[-1] if key in LAST_OF_INTERVAL else sum(finite) / len(finite) if finite else math.nan
    return merged

MODEL_CARD_FIELDS = ("loss_type", "learning_rate", "num_generations", "max_completion_length", "beta", "epsilon",
                     "epsilon_high", "scale_rewards", "temperature", "num_iterations", "use_peft", "seed")


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in (before, after]."""
    return after // every > before // every


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


def _without_samples(result: dict | None) -> dict | None:
    return None if result is None else {k: v for k, v in result.items() if k != "samples"}
