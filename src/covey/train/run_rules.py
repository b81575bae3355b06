"""The rules of a run (``covey.rules``' second and third phases): what the trainer was handed and how
the run was launched, checked before any policy weights load (``RUN_RULES``), and its rows once loaded
(``ROW_RULES``: data named by a file or a task is read after those); and the rollout engine, once built
(``ENGINE_RULES``, and ``ENGINE_ROW_RULES`` against the rows). Rules written elsewhere (the launcher's, a
sharded run's, the engine's interface...) are named here, so that this table lists every one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from covey.config import GRPOConfig
from covey.data import is_stream
from covey.models import bfloat16_products_in_software, default_device, resolve_model_path
from covey.plan import MemoryCheckSkipped, check_fits
from covey.rollout.vllm_engine import check_vllm
from covey.rules import VESPO_SEQUENCE_CORRECTION, Need
from covey.telemetry.trackers import check_trackers
from covey.train.asynchronous import check_async_run
from covey.train.callbacks import check_callbacks
from covey.train.distributed import check_launcher_settings
from covey.train.setup import (check_data_and_rewards_given, check_engine, check_model_settings, engine_correction,
                               engine_name, uses_lora)
from covey.train.sharding import Sharding, check_sharded_run
from covey.train.vision_run import engine_reads_pictures, pictures, vision_tower

SYNC_WITH_LORA = ("sync_ref_model cannot be used with a LoRA policy (use_peft, peft_config or a model with an "
                  "adapter): its reference is the base model with the adapter disabled, not a copy to sync")


@dataclass(frozen=True)
class Handed:
    """What ``GRPOTrainer`` was handed (as given, None where not) and how the run was launched."""

    model: Any = None
    train_dataset: Any = None
    reward_funcs: Any = None
    processing_class: Any = None
    peft_config: Any = None
    rollout_engine: Any = None
    rollout_func: Any = None
    tools: Any = None
    environment_factory: Any = None
    tool_call_format: Any = None
    callbacks: Any = None
    optimizers: Any = (None, None)  # TRL's (optimizer, learning-rate scheduler), either None for covey's
    processes: int = 1  # launched (WORLD_SIZE)

    def has_tools(self, c: GRPOConfig) -> bool:
        return bool(self.tools or c.tools or self.environment_factory is not None or c.environment_factory)

    def model_source(self, c: GRPOConfig) -> str | None:
        """The folder or hub id the model comes from (a model object's own name), None where it has none."""
        model = self.model
        return (model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
                ) or (c.model if model is None else None)


def launch(c: GRPOConfig, h: Handed, need: Need) -> None:
    """How the processes were launched: a colocated vLLM in one process only, the launcher's precision,
    a sharded run's settings."""
    need(not (h.processes > 1 and h.rollout_engine is None and c.rollout_engine == "vllm" and c.vllm_mode == "colocate"),
         f"rollout_engine: vllm with vllm_mode: colocate runs in a single process, and this run has {h.processes} "
         "(WORLD_SIZE); with several processes use vllm_mode: server (one `covey server` for all of them) or "
         "rollout_engine: fast, or train in one process")
    check_launcher_settings(c.bf16)
    if Sharding.from_settings(c.fsdp, c.fsdp_config, os.environ) is not None:
        check_sharded_run(c)


def data_and_rewards(c: GRPOConfig, h: Handed, need: Need) -> None:
    """The data and rewards are given (an environment may bring either), and the trackers exist; a streamed
    dataset has no length to count epochs by."""
    need(not (is_stream(h.train_dataset) and c.max_steps == -1),
         "train_dataset is a stream (an IterableDataset or an iterator), whose length is not known before it ends, "
         "so num_train_epochs cannot set the run's length: set max_steps (as TRL asks for an IterableDataset)")
    funcs = [h.reward_funcs] if callable(h.reward_funcs) or isinstance(h.reward_funcs, str) else h.reward_funcs
    check_data_and_rewards_given(c, h.train_dataset, funcs, h.environment_factory)
    check_trackers(c.report_to)


def generation_source(c: GRPOConfig, h: Handed, need: Need) -> None:
    """Where completions come from: the engine, tools and environments, or the user's rollout_func; and
    the engine handed over has what the trainer calls."""
    check_callbacks(h.callbacks or [])
    need(h.rollout_func is None or not h.has_tools(c), "rollout_func generates the completions itself, so tools and "
         "environment_factory would go unused: give one or the other")
    need(h.tool_call_format is None or h.has_tools(c), "tool_call_format reads tool calls, and this run has no tools "
         "or environment_factory: give tools, or leave tool_call_format out")
    if h.rollout_engine is not None:
        check_engine(h.rollout_engine, episodes=h.has_tools(c))
    elif engine_name(c) == "vllm":
        source = h.model_source(c)
        check_vllm(c.vllm_enable_sleep_mode, resolve_model_path(source) if source else None)
    check_async_run(c, h.processes, h.rollout_engine, h.rollout_func is not None,
                    engine_name(c) == "server" or getattr(h.rollout_engine, "shared_by_processes", False))


def model_and_adapter(c: GRPOConfig, h: Handed, need: Need) -> None:
    """The model has a tokenizer to load, the loading settings fit how it is given, and a LoRA policy
    has no reference to sync."""
    need(h.model_source(c) is not None or h.processing_class is not None,
         "the model object has no name or folder to load its tokenizer from (config._name_or_path is empty): "
         "give processing_class=its tokenizer")
    need(not (c.sync_ref_model and uses_lora(c, h.model, h.peft_config)), SYNC_WITH_LORA)
    check_model_settings(c, h.model, h.peft_config)


def optimizers(c: GRPOConfig, h: Handed, need: Need) -> None:
    """TRL's ``optimizers=(optimizer, scheduler)``: a pair; an optimizer of the user's own holds every
    parameter whole, so not under FSDP or shard_optimizer_state; a scheduler needs its optimizer."""
    pair = h.optimizers
    need(isinstance(pair, (tuple, list)) and len(pair) == 2,
         f"optimizers must be a pair (optimizer, lr_scheduler), either None for covey's, not {pair!r}")
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2) or pair[0] is None:
        need(not (isinstance(pair, (tuple, list)) and len(pair) == 2 and pair[1] is not None),
             "optimizers=(None, scheduler): a learning-rate scheduler schedules its optimizer; give both, or neither")
        return
    need(hasattr(pair[0], "step") and hasattr(pair[0], "param_groups"),
         f"optimizers[0] must be a torch optimizer, not {type(pair[0]).__name__}")
    need(not c.fsdp, "optimizers=(optimizer, ...) with fsdp: a sharded model's parameters are made when it is "
                     "sharded, after your optimizer; leave optimizers out (covey's AdamW takes the adam_* fields)")
    need(not (c.shard_optimizer_state and h.processes > 1),
         "optimizers=(optimizer, ...) with shard_optimizer_state: covey shards its own AdamW's state only; turn "
         "shard_optimizer_state off, or leave optimizers out")


def fits_the_device(c: GRPOConfig, h: Handed, need: Need) -> str | None:
    """A step covey's estimate puts clearly beyond the device's memory is refused, with the plan's advice
    (``covey.plan.check_fits``, with the prompts measured in the data handed over or named; memory_check: false
    trains anyway). A model handed over loaded is left out:
    it is in memory already. A config the estimate cannot read: the note that the check was skipped."""
    if h.model is None or isinstance(h.model, str):
        try:
            check_fits(c if h.model is None else c.replace(model=h.model), h.processes, h.train_dataset,
                       h.has_tools(c))
        except MemoryCheckSkipped as skipped:
            return str(skipped)
    return None


def bfloat16_on_this_cpu(c: GRPOConfig, h: Handed, need: Need) -> str | None:
    """A note where a run asks for bfloat16 on a CPU whose bfloat16 products torch runs in software:
    under bf16 or rollout_bf16 covey computes them in float32 (the same numbers, no faster than float32
    there); weights loaded in bfloat16 without bf16 multiply in software, many times slower."""
    device = default_device(c.use_cpu)
    if not bfloat16_products_in_software(device):
        return None
    if c.dtype == "bfloat16" and not c.bf16:
        return ("covey: torch has no bfloat16 matrix products on this CPU (no AVX-512 or AMX), so a model loaded in "
                "bfloat16 (dtype: bfloat16) multiplies in software, many times slower than float32; set dtype: "
                "float32, or add bf16: true, whose products covey computes in float32 here")
    if c.bf16 or c.sample_in_bf16(device.type):
        return ("covey: torch has no bfloat16 matrix products on this CPU (no AVX-512 or AMX), so covey computes "
                "bfloat16's in float32 from their bfloat16 operands (the same numbers); bfloat16 saves no time here, "
                "float32 (bf16: false, rollout_bf16: false) is a little faster and exact")
    return None


RUN_RULES = (launch, data_and_rewards, generation_source, model_and_adapter, optimizers, vision_tower,
             fits_the_device, bfloat16_on_this_cpu)
# on what the trainer was handed with its rows loaded (``Handed.train_dataset`` the rows), before any policy
# weights load
ROW_RULES = (pictures,)


# ---- the rollout engine, once built --------------------------------------------------------


def vespo_with_engine_correction(c: GRPOConfig, engine: Any, own_rollouts: bool, need: Need) -> None:
    """VESPO folds the engine correction in token by token: a sequence-level one is refused where it applies."""
    correction = engine_correction(c)
    applies = not (engine.exact_logprobs and not own_rollouts)
    need(not (c.loss_type == "vespo" and correction is not None and correction.level == "sequence" and applies),
         f"{VESPO_SEQUENCE_CORRECTION} (this run's {type(engine).__name__} samples from other log-probs than the "
         "trainer's, so the correction applies)")


ENGINE_RULES = (vespo_with_engine_correction,)
ENGINE_ROW_RULES = (engine_reads_pictures,)  # the engine, the training rows and the policy
