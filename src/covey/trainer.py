"""The GRPO trainer: set-up, then one step at a time in the order of the algorithm.

    for each step:
        generate    G completions per prompt with the rollout engine
        score       every reward function, combined with reward_weights
        advantage   group-relative, per prompt
        log-probs   old (only when reused over several iterations) and reference (only when beta > 0)
        loss, step  clipped surrogate over micro-batches, gradient clipping, AdamW, schedule

Groups stay whole inside one generation batch, and reward statistics are computed from the full
batch tensors, so a data-parallel version only needs to gather rewards across ranks before the
advantage and to shard rows after it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import torch

from covey import core
from covey.config import GRPOConfig
from covey.errors import ConfigError
from covey.data import PromptSampler, extra_columns, heldout_rows, is_conversational, load_rows
from covey.evaluation import evaluate
from covey.logprobs import SequenceBatch, completion_logprobs
from covey.models import (Reference, add_lora, autocast, eos_token_ids, is_peft_model, load_policy, load_tokenizer,
                          prepare_tokenizer)
from covey.rewards import (RewardFunc, combine_rewards, completion_text, load_reward_func, preflight_check, reward_name,
                           score_completions)
from covey.rollout import HFEngine, Rollout, RolloutEngine, SamplingParams, left_pad
from covey.telemetry import RunLog, print_summary
from covey.text import decode_completions, encode_prompts


@dataclasses.dataclass
class GenerationBatch:
    """Everything one generation round produced, ready for the optimisation passes."""

    sequences: SequenceBatch
    rewards_BF: torch.Tensor  # (B, F) per reward function, NaN = None
    rewards_B: torch.Tensor  # (B,) weighted sum
    advantages_B: torch.Tensor  # (B,)
    zero_std_N: torch.Tensor  # (N,) groups whose rewards were all equal
    finish_reasons: list[str]
    old_logp_BT: torch.Tensor | None  # None: the policy has not moved since generation (ratio is 1)
    ref_logp_BT: torch.Tensor | None  # None when beta == 0
    records: list[dict]  # prompt / completion / rewards per row, for completions.jsonl


def make_run_dir(args: GRPOConfig) -> Path:
    """The run folder; refuses to write into one that already holds files unless told to."""
    if args.output_dir is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir, n = Path("runs") / stamp, 1
        while run_dir.exists():
            n += 1
            run_dir = Path("runs") / f"{stamp}-{n}"
    else:
        run_dir = Path(args.output_dir)
        if run_dir.exists() and any(run_dir.iterdir()) and not args.overwrite_output_dir:
            raise ConfigError(f"output_dir {run_dir} already holds files; choose a new output_dir "
                              "(nothing is overwritten unless you pass --overwrite-output-dir true)")
    return run_dir


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
        if callable(reward_funcs) or isinstance(reward_funcs, str):
            reward_funcs = [reward_funcs]
        self.reward_funcs = [load_reward_func(f) for f in (reward_funcs or args.reward_funcs)]
        self.reward_weights = args.reward_weights or [1.0] * len(self.reward_funcs)
        if len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(f"reward_weights has {len(self.reward_weights)} values for "
                              f"{len(self.reward_funcs)} reward functions; give one weight per function")
        dataset = train_dataset if train_dataset is not None else args.dataset
        self.train_rows = load_rows(dataset, split=args.dataset_split)
        preflight_check(self.reward_funcs, self.train_rows)
        self.eval_rows = heldout_rows(dataset, eval_dataset if eval_dataset is not None else args.eval_dataset,
                                      args.eval_max_samples)
        self.run_dir = make_run_dir(args)
        torch.manual_seed(args.seed)

        if processing_class is not None:
            self.tokenizer = processing_class
            prepare_tokenizer(self.tokenizer)
        else:
            source = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
            self.tokenizer = load_tokenizer(source or args.model, args.trust_remote_code)
        self.prompt_ids = encode_prompts(self.tokenizer, [r["prompt"] for r in self.train_rows],
                                         args.max_prompt_length, "train_dataset")

        self.model = model if isinstance(model, torch.nn.Module) else load_policy(model or args.model,
                                                                                   args.trust_remote_code)
        if (args.use_peft or peft_config is not None) and not is_peft_model(self.model):
            if peft_config is not None:
                from peft import get_peft_model

                self.model = get_peft_model(self.model, peft_config)
            else:
                self.model = add_lora(self.model, args.lora_r, args.lora_alpha, args.lora_dropout,
                                      args.lora_target_modules)
        if args.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.reference = Reference(self.model) if args.beta > 0 else None
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.engine = rollout_engine or HFEngine(self.model, self.tokenizer.pad_token_id, self.eos_ids, args.bf16)
        self.device = next(self.model.parameters()).device
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                           eps=args.adam_epsilon, weight_decay=args.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.sampler = PromptSampler(len(self.train_rows), args.generation_batch_size // args.num_generations, args.seed)
        self.quiet = quiet
        self.global_step = 0

    def _lr_factor(self, step: int) -> float:
        """Linear warmup over warmup_ratio * max_steps, then the chosen decay."""
        warmup = math.ceil(self.args.warmup_ratio * self.args.max_steps)
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, self.args.max_steps - warmup)
        return {"constant": 1.0, "linear": 1.0 - progress,
                "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[self.args.lr_scheduler_type]

    # ---- the loop ---------------------------------------------------------------------------

    def train(self) -> dict:
        """Run max_steps optimizer steps; returns the summary that is also written to summary.json."""
        args = self.args
        self.run_dir.mkdir(parents=True, exist_ok=True)
        args.save(self.run_dir / "config.yaml")
        with RunLog(self.run_dir, args.max_steps, quiet=self.quiet) as log:
            before = self.evaluate() if self.eval_rows else None
            if before:
                log.info(f"held-out accuracy before training: {100 * before['accuracy']:.1f}% "
                         f"(mean reward {before['mean_reward']:.3f}, n={before['n']})")
            while self.global_step < args.max_steps:
                self._generation_round(log)
            after = self.evaluate() if self.eval_rows else None
        summary = self._write_outputs(before, after, log.history)
        if not self.quiet:
            print_summary(log.console, before, after, self.run_dir)
        return summary

    def _generation_round(self, log: RunLog) -> None:
        """One generation batch and its num_iterations optimizer steps."""
        start = time.perf_counter()
        batch, timings = self.generate_and_score(next(self.sampler))
        for _ in range(self.args.num_iterations):
            if self.global_step >= self.args.max_steps:
                break
            t_train = time.perf_counter()
            stats = self.optimize(batch)
            self.global_step += 1
            timings["time/train"] = time.perf_counter() - t_train
            step_time = time.perf_counter() - start
            start = time.perf_counter()
            if self.global_step % self.args.logging_steps == 0 or self.global_step == self.args.max_steps:
                log.log_metrics(self.global_step, self._metrics(batch, stats, timings, step_time))
            timings = {"time/generate": 0.0, "time/score": 0.0}
        if self.args.log_completions:
            log.log_completions(self.global_step, batch.records)

    def generate_and_score(self, indices: list[int]) -> tuple[GenerationBatch, dict[str, float]]:
        """Steps 1-4 for the training rows at ``indices``."""
        args, G = self.args, self.args.num_generations
        # 1. generate
        t0 = time.perf_counter()
        prompt_ids = [self.prompt_ids[i] for i in indices]
        params = SamplingParams(args.max_completion_length, args.temperature, args.top_p, args.top_k)
        rollout = self.engine.generate(prompt_ids, G, params, seed=args.seed + self.global_step)
        t1 = time.perf_counter()
        # 2. score
        rows = [self.train_rows[i] for i in indices for _ in range(G)]
        completions, completion_ids = decode_completions(self.tokenizer, rollout.completion_ids_BT,
                                                         rollout.completion_mask_BT, is_conversational(rows))
        rewards_BF = score_completions(self.reward_funcs, [r["prompt"] for r in rows], completions,
                                       completion_ids, extra_columns(rows))
        rewards_B = combine_rewards(rewards_BF, self.reward_weights).float()
        t2 = time.perf_counter()
        # 3. advantages
        advantages_B, zero_std_N = core.group_advantages(rewards_B, G, args.scale_rewards)
        # 4. log-probs of the policy that generated (only needed when it will have moved) and of the reference
        sequences = self._sequences(prompt_ids, rollout)
        old_logp_BT = self._logprobs_no_grad(self.model, sequences) if args.num_iterations > 1 else None
        ref_logp_BT = None
        if self.reference is not None:
            with self.reference.model() as ref_model:
                ref_logp_BT = self._logprobs_no_grad(ref_model, sequences)
        records = [{"prompt": r["prompt"], "completion": completion_text(c), "answer": r.get("answer"),
                    "rewards": {reward_name(f): _none_if_nan(v) for f, v in zip(self.reward_funcs, rewards_BF[i].tolist())},
                    "reward": float(rewards_B[i]), "advantage": float(advantages_B[i]),
                    "finish_reason": rollout.finish_reasons[i]} for i, (r, c) in enumerate(zip(rows, completions))]
        batch = GenerationBatch(sequences, rewards_BF, rewards_B, advantages_B, zero_std_N, rollout.finish_reasons,
                                old_logp_BT, ref_logp_BT, records)
        return batch, {"time/generate": t1 - t0, "time/score": t2 - t1}

    def optimize(self, batch: GenerationBatch) -> dict[str, float]:
        """5-6. One optimizer step over all micro-batches of the generation batch."""
        args = self.args
        self.model.train()
        mask_BT = batch.sequences.completion_mask_BT
        counts = core.BatchCounts(sequences=mask_BT.shape[0], tokens=int(mask_BT.sum()),
                                  micro_batches=args.gradient_accumulation_steps,
                                  max_completion_length=args.max_completion_length)
        totals: dict[str, float] = {"loss": 0.0}
        for start in range(0, mask_BT.shape[0], args.per_device_train_batch_size):
            rows = slice(start, start + args.per_device_train_batch_size)
            micro = batch.sequences.rows(rows)
            with autocast(self.device, args.bf16):
                logp_BT, entropy_BT = completion_logprobs(self.model, micro, args.temperature, with_entropy=True)
            T = micro.completion_ids_BT.shape[1]
            old_BT = logp_BT.detach() if batch.old_logp_BT is None else batch.old_logp_BT[rows, :T].to(self.device)
            ref_BT = None if batch.ref_logp_BT is None else batch.ref_logp_BT[rows, :T].to(self.device)
            micro_mask = micro.completion_mask_BT.to(self.device)
            loss, stats = core.policy_loss(
                logp_BT, old_BT, batch.advantages_B[rows].to(self.device), micro_mask, counts, args.loss_type,
                args.epsilon, args.epsilon if args.epsilon_high is None else args.epsilon_high, args.beta, ref_BT,
                entropy_BT)
            loss.backward()
            totals["loss"] += float(loss.detach())
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals["grad_norm"] = grad_norm
        return totals

    # ---- helpers ----------------------------------------------------------------------------

    def _sequences(self, prompt_ids: list[list[int]], rollout: Rollout) -> SequenceBatch:
        repeated = [ids for ids in prompt_ids for _ in range(self.args.num_generations)]
        prompt_ids_BP, prompt_mask_BP = left_pad(repeated, self.tokenizer.pad_token_id)
        return SequenceBatch(prompt_ids_BP, prompt_mask_BP, rollout.completion_ids_BT, rollout.completion_mask_BT)

    @torch.no_grad()
    def _logprobs_no_grad(self, model: torch.nn.Module, sequences: SequenceBatch) -> torch.Tensor:
        """Full-batch log-probs (B, T) padded to the batch width, in micro-batches."""
        B, T = sequences.completion_ids_BT.shape
        out = torch.zeros(B, T)
        for start in range(0, B, self.args.per_device_train_batch_size):
            rows = slice(start, start + self.args.per_device_train_batch_size)
            micro = sequences.rows(rows)
            with autocast(self.device, self.args.bf16):
                logp, _ = completion_logprobs(model, micro, self.args.temperature)
            out[rows, : logp.shape[1]] = logp.float().cpu()
        return out

    def _metrics(self, batch: GenerationBatch, stats: dict[str, float], timings: dict[str, float],
                 step_time: float) -> dict[str, float]:
        G = self.args.num_generations
        lengths_B = batch.sequences.completion_mask_BT.sum(1).float()
        tokens = max(stats["tokens"], 1.0)
        metrics = {
            "reward": float(batch.rewards_B.mean()),
            "reward_std": float(batch.rewards_B.view(-1, G).std(dim=1).mean()),
            "frac_reward_zero_std": float(batch.zero_std_N.float().mean()),
        }
        for j, func in enumerate(self.reward_funcs):
            column = batch.rewards_BF[:, j]
            metrics[f"rewards/{reward_name(func)}/mean"] = float(column.nanmean())
            metrics[f"rewards/{reward_name(func)}/std"] = float(column[~column.isnan()].std()) if (~column.isnan()).sum() > 1 else 0.0
        if self.args.beta > 0:
            metrics["kl"] = stats["kl_sum"] / tokens
        metrics.update({
            "loss": stats["loss"],
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
            "step_time": step_time,
            **timings,
            "tokens_per_second": float(lengths_B.sum()) / step_time if timings.get("time/generate") else 0.0,
        })
        return metrics

    def evaluate(self, rows: list[dict] | None = None) -> dict:
        """Greedy accuracy and mean reward on held-out rows (default: the configured eval split)."""
        rows = rows if rows is not None else self.eval_rows
        if not rows:
            raise ConfigError("no held-out data to evaluate on: set eval_dataset")
        return evaluate(self.engine, self.tokenizer, rows, self.reward_funcs, self.reward_weights,
                        self.args.max_completion_length, self.args.max_prompt_length)

    def _write_outputs(self, before: dict | None, after: dict | None, history: list[dict]) -> dict:
        final = self.run_dir / "final_model"
        self.model.save_pretrained(final, safe_serialization=True)
        self.tokenizer.save_pretrained(final)
        summary = {
            "steps": self.global_step,
            "model": self.args.model,
            "dataset": self.args.dataset if isinstance(self.args.dataset, str) else "train_dataset",
            "final_model": str(final),
            "before": _without_samples(before),
            "after": _without_samples(after),
            "final_metrics": history[-1] if history else None,
        }
        if before and after:
            summary["accuracy_change"] = after["accuracy"] - before["accuracy"]
            summary["eval_samples"] = {"before": before["samples"][:8], "after": after["samples"][:8]}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


def _without_samples(result: dict | None) -> dict | None:
    return None if result is None else {k: v for k, v in result.items() if k != "samples"}
