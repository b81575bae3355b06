"""What TRL's ``GRPOTrainer`` and transformers' ``Trainer`` expose that scripts, callbacks and tests use.

``GRPOTrainer`` takes these members from ``TRLSurface``; each reads the run's own parts, so nothing here
holds state of its own beyond what the user gave (the datasets). What is deliberately absent, and why,
is listed in docs/trl.md ("The trainer's public surface").
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from covey import core
from covey.data import load_rows
from covey.errors import ConfigError
from covey.rewards import RewardModel, check_reward_columns
from covey.train import rounds, update
from covey.train.batch import Prompts
from covey.train.distributed import World


class TrainingClock:
    """What the closing entry of a train() call reports: its wall time and the optimizer steps it took."""

    def __init__(self, first_step: int):
        self.started, self.first_step = time.time(), first_step

    def closing_metrics(self, last_step: int, completions_per_step: int, history: list[dict]) -> dict[str, float]:
        """transformers' closing log entry of a train() call: train_runtime, its throughputs, train_loss (the
        mean loss of the steps this call took) and total_flos, 0.0: covey counts no floating-point
        operations (transformers gives 0.0 too for a model it cannot count)."""
        runtime = round(time.time() - self.started, 4)
        steps = last_step - self.first_step
        metrics: dict[str, float] = {"train_runtime": runtime}
        if runtime > 0:
            metrics["train_samples_per_second"] = round(steps * completions_per_step / runtime, 3)
            metrics["train_steps_per_second"] = round(steps / runtime, 3)
        metrics["total_flos"] = 0.0
        metrics["train_loss"] = training_loss(history, self.first_step)
        return metrics


def closing_entry(history: list[dict], step: int, metrics: dict[str, float]) -> dict[str, float]:
    """The closing log entry of train(): ``metrics`` beside the metrics logged at ``step``, the last, as
    TRL's closing entry holds the steps' metrics it had not logged yet."""
    last = history[-1] if history and history[-1].get("step") == step else {}
    return {**{k: v for k, v in last.items() if k not in ("step", "epoch")}, **metrics}


def training_loss(history: list[dict], first_step: int) -> float:
    """The mean loss of the optimizer steps after ``first_step``, from the logged entries (each the mean
    over the steps since the one before, so each counts as many times as the steps it covers); steps
    whose loss was not finite are left out, as transformers' logging does. NaN when none is left."""
    total, steps, previous = 0.0, 0, first_step
    for entry in history:
        step, loss = entry.get("step", 0), entry.get("loss")
        if step <= first_step:
            continue
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            total, steps = total + loss * (step - previous), steps + step - previous
        previous = step
    return total / steps if steps else math.nan


@torch.no_grad()
def grpo_loss_on(parts: Any, prompts: Prompts) -> float:
    """The GRPO loss on held-out ``prompts``, as TRL's evaluate() reports it (eval_loss): num_generations
    completions of each, sampled and scored as in training, their advantages, and the loss at ratio 1 (the
    policy that sampled is the one scored) with the KL term where beta > 0. The entropy terms (masking, the
    bonus) and a router's loss are left out: they measure the training pass, not the held-out data."""
    eval_parts = dataclasses.replace(parts, prompts=prompts)
    batch = rounds.score_prompts(eval_parts, list(range(len(prompts.rows))))
    samples = batch.samples
    logp_BT = update.logprobs_no_grad(parts, parts.policy.model, samples.sequences)
    ref_BT = None
    if parts.policy.reference is not None:
        with parts.policy.reference.model() as ref_model:
            ref_BT = update.logprobs_no_grad(parts, ref_model, samples.sequences)
    mask_BT = samples.loss_mask_BT.float()
    counts = core.BatchCounts(samples.size, float(mask_BT.sum()), 1, parts.args.max_completion_length)
    settings = dataclasses.replace(parts.loss_settings, top_entropy_quantile=1.0, entropy_bonus=core.EntropyBonus(),
                                   router_aux_loss_coef=0.0)
    loss, _ = core.policy_loss(logp_BT, logp_BT, batch.advantages_B, mask_BT, counts, settings, ref_BT,
                               behaviour_logp_BT=logp_BT)
    return float(loss)


def named_eval_sets(eval_dataset: Any) -> dict[str, Any]:
    """TRL's eval_dataset as {name: dataset}: one set under '' (a list, a Dataset, an IterableDataset, a
    spec), or several, from a dict or a DatasetDict, each under its key."""
    if isinstance(eval_dataset, dict):  # a DatasetDict and IterableDatasetDict are dicts too
        if not eval_dataset:
            raise ConfigError("eval_dataset is an empty dict: give a dataset, or a dict of named datasets")
        return dict(eval_dataset)
    return {"": eval_dataset}


class TRLSurface:
    """TRL's and transformers' public members, over the run's parts (``self.parts``)."""

    # ---- the rewards, as TRL names them --------------------------------------------------------

    @property
    def reward_funcs(self) -> list:
        """The reward functions, in order: callables as given, reward models as covey wraps them."""
        return list(self.parts.rewards.funcs)

    @property
    def reward_func_names(self) -> list[str]:
        """The names their metrics go under (rewards/<name>/mean)."""
        return list(self.parts.rewards.names)

    @property
    def reward_weights(self) -> torch.Tensor:
        return torch.tensor(self.parts.rewards.weights, dtype=torch.float32)

    @property
    def reward_processing_classes(self) -> list:
        """One per reward function: a reward model's tokenizer, None for the others."""
        return [f.tokenizer if isinstance(f, RewardModel) else None for f in self.parts.rewards.funcs]

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The frozen reference copy (None when beta is 0, or for a LoRA policy, whose reference is the base
        model with the adapter disabled), as TRL."""
        return None if self.parts.policy.reference is None else self.parts.policy.reference.frozen

    @property
    def aux_loss_enabled(self) -> bool:
        """Whether the loss includes a mixture-of-experts router's load-balancing loss (logged as aux_loss)."""
        return self.parts.loss_settings.router_aux_loss_coef != 0

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (moved after each step under use_adaptive_entropy)."""
        return self.progress.entropy_coef

    @property
    def tools(self) -> list:
        """The functions the model may call: the standalone tools, then the environments' methods (of their
        classes, unbound: each episode binds its own instance), as TRL lists them."""
        agent = self.parts.sampler.agent
        if agent is None:
            return []
        methods = {}  # every environment's, a name once
        for kind in agent.environment.kinds.values() if agent.environment else []:
            for name in kind.tool_names:
                methods.setdefault(name, getattr(kind.cls, name))
        return [tool.function for tool in agent.tools] + list(methods.values())

    # ---- the model ---------------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The policy being trained."""
        return self.parts.policy.model

    @model.setter
    def model(self, value: torch.nn.Module) -> None:
        if value is not self.parts.policy.model:
            raise ConfigError("trainer.model cannot be replaced once the trainer is built: its optimizer, sampler "
                              "and reference hold the policy; build a new GRPOTrainer(model=...) instead")

    # ---- transformers' Trainer ----------------------------------------------------------------

    def end(self) -> None:
        """transformers' close of a run after train(): covey's trackers closed with train() already; the
        process group this process started is left (``World.leave``)."""
        World.leave()

    def is_world_process_zero(self) -> bool:
        return self.world.is_main

    def is_local_process_zero(self) -> bool:
        return self.callback_handler.state.is_local_process_zero

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add ``logs`` to state.log_history with the epoch and step, and hand them to the callbacks'
        on_log, as transformers does (metrics.jsonl keeps the training steps only)."""
        self.callback_handler.log(self.global_step, dict(logs), from_main=False)

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` of ``split`` (train, eval), one per line, on the first process."""
        if self.world.is_main and not self.quiet:
            print(f"***** {split} metrics *****")
            for key in sorted(metrics):
                print(f"  {key:<32} = {metrics[key]}")

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """``split``_results.json in the run folder (and all_results.json, merged, with ``combined``)."""
        if not self.world.is_main:
            return
        (self.run_dir / f"{split}_results.json").write_text(json.dumps(metrics, indent=4, sort_keys=True))
        if combined:
            path = self.run_dir / "all_results.json"
            merged = json.loads(path.read_text()) if path.is_file() else {}
            path.write_text(json.dumps({**merged, **metrics}, indent=4, sort_keys=True))

    def save_state(self) -> None:
        """trainer_state.json in the run folder: transformers' TrainerState, log_history included."""
        if self.world.is_main:
            self.callback_handler.state.save_to_json(str(self.run_dir / "trainer_state.json"))

    def create_model_card(self, **_: Any) -> Path:
        """The model card: train() writes it beside the final model (README.md there); its path."""
        card = self.run_dir / "final_model" / "README.md"
        if not card.is_file():
            raise ConfigError("the model card is written by train(), beside the final model; call train() first")
        return card

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Held-out metrics under TRL's names for ``eval_dataset`` (default: the run's held-out rows):
        ``<prefix>_loss`` (``held_out_loss``), and covey's greedy ``<prefix>_accuracy``, ``<prefix>_mean_reward``
        and ``<prefix>_n``; a dict of datasets gives each under ``<prefix>_<name>_...``. Also handed to the
        callbacks and state.log_history."""
        sets = {"": None} if eval_dataset is None else named_eval_sets(eval_dataset)
        metrics: dict[str, float] = {}
        for name, dataset in sets.items():
            rows = self.eval_rows if dataset is None else self.heldout_rows_of(dataset)
            if not rows:
                raise ConfigError("no held-out data to evaluate on: give evaluate(eval_dataset=...), or eval_dataset "
                                  "to the trainer")
            result = {**self.held_out_result(rows), "loss": self.held_out_loss(rows)}
            prefix = f"{metric_key_prefix}_{name}_" if name else f"{metric_key_prefix}_"
            metrics.update({prefix + key: result[key] for key in ("loss", "accuracy", "mean_reward", "n")
                            if key not in (ignore_keys or ())})
        self.log(metrics)
        return metrics

    def heldout_rows_of(self, dataset: Any) -> list[dict]:
        """The rows of a dataset handed to evaluate() (its eval_split where it is a spec with splits),
        checked against the reward functions' columns."""
        rows = load_rows(dataset, split=self.args.eval_split, system_prompt=self.args.system_prompt)
        check_reward_columns(rows, self.parts.rewards.funcs, "eval_dataset")
        return rows

    # ---- TRL's helpers, as its tests call them --------------------------------------------------

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """True on the tokens (of ``mask``) whose entropy is at least its ``threshold`` quantile (TRL's
        signature: the quantile below the kept tokens)."""
        return core.high_entropy_mask(entropies, mask, 1 - threshold).bool()

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """DeepSeek-V3.2's off-policy sequence mask in TRL's signature (covey.core.off_policy_mask)."""
        return core.off_policy_mask(per_token_logps, sampling_per_token_logps, advantages, mask, off_policy_threshold)
