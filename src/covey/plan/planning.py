"""The plan of a run: its settings read from the config and the prompts' measured lengths, the estimate,
the device, and the same plan with other settings (``replan``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from covey.config import GRPOConfig
from covey.core import logprob_chunk_tokens
from covey.plan.device import Device, this_device
from covey.plan.memory import Breakdown, Settings, estimate
from covey.plan.prompts import PromptLengths, measure_prompts
from covey.plan.shapes import ModelShape, model_config, model_shape

# covey train refuses a run whose estimate is over this many times the device's whole memory. The
# estimates are checked to within 20% of the measured peak (BENCHMARKS.md), so a run refused at 1.5x
# would still need at least 1.25x the device: it cannot fit, and a run that fits is never refused.
REFUSE_OVER = 1.5
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def lora_targets(args: GRPOConfig, shape: ModelShape) -> tuple[str, ...]:
    """The linear layers a LoRA adapter wraps: the config's, every one for all-linear, else peft's default
    for the architecture (q_proj and v_proj for Llama and Qwen)."""
    names = tuple(lin.name for lin in shape.layer_linears)
    if args.lora_target_modules == ["all-linear"]:
        return names
    if args.lora_target_modules:
        return tuple(n for n in names if n in args.lora_target_modules)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    return tuple(n for n in names if n in DEFAULTS.get(shape.model_type, ["q_proj", "v_proj"]))


def weight_bytes(args: GRPOConfig, config) -> int:
    if args.dtype != "auto":
        return DTYPE_BYTES[args.dtype]
    saved = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    return DTYPE_BYTES.get(saved.removeprefix("torch."), 4)


def engine_kind(args: GRPOConfig) -> str:
    if args.rollout_engine == "vllm":
        return "server" if args.vllm_mode == "server" else "vllm"
    return args.rollout_engine


def settings_from_config(args: GRPOConfig, shape: ModelShape, config, processes: int, device: Device,
                         prompt_length: int | None = None) -> Settings:
    """What the estimate needs of a run, read from its config; every prompt ``prompt_length`` tokens (the
    longest measured, at most max_prompt_length; None: max_prompt_length)."""
    engine = engine_kind(args)
    rollout_bf16 = args.sample_in_bf16(device.kind)
    lora = args.use_peft or args.quantization is not None
    return Settings(
        micro_batch=args.per_device_train_batch_size, generation_rows=args.generation_batch_size,
        num_generations=args.num_generations,
        prompt_length=args.max_prompt_length if prompt_length is None else min(prompt_length, args.max_prompt_length),
        completion_length=args.max_completion_length, weight_bytes=weight_bytes(args, config),
        bf16_autocast=args.bf16, gradient_checkpointing=args.gradient_checkpointing,
        lora_targets=lora_targets(args, shape) if lora else None, lora_r=args.lora_r,
        lora_dropout=args.lora_dropout > 0 and not args.disable_dropout, dora=args.use_dora,
        quantization=args.quantization, reference=args.beta > 0,
        processes=processes, fsdp=args.fsdp.split()[0] if args.fsdp.split() else "",
        shard_optimizer_state=args.shard_optimizer_state, engine=engine, rollout_bf16=rollout_bf16,
        bfloat16_copy_bytes=4 if device.bfloat16_in_software else 2,
        engine_copies_weights=engine == "fast" and device.kind == "cpu" and not _decode_kernel_runs(),
        vllm_share_bytes=int(args.vllm_gpu_memory_utilization * device.total) if engine == "vllm" else 0,
        eager_attention=args.attn_implementation == "eager", head_in_float32=args.cast_lm_head_to_fp32,
        logprob_chunk=logprob_chunk_tokens(shape.vocab, args.logprob_budget_bytes(shape.vocab, device.available)),
        accumulating=args.gradient_accumulation_steps > 1,
        entropy_bonus=args.entropy_coef > 0 or args.use_adaptive_entropy)


def _decode_kernel_runs() -> bool:
    """Whether the fast engine's float32 decode kernel runs here (it then samples from the model's own
    matrices; without it, from a prepacked copy)."""
    try:
        from covey.rollout.fast import decode_kernel

        return decode_kernel.available()
    except Exception:  # no compiler, no library: the copy
        return False


@dataclass(frozen=True)
class Plan:
    """The estimate of a run: the model's shape, the prompts' lengths, the settings read, the breakdown,
    the device and whether the step fits in it (with the runtime's own memory where the device is the CPU)."""

    args: GRPOConfig
    config: object  # the model's transformers config
    shape: ModelShape
    prompts: PromptLengths
    settings: Settings
    breakdown: Breakdown
    device: Device

    @property
    def needed(self) -> int:
        """The step's peak, plus the process's runtime on a CPU (python, torch, transformers)."""
        return self.breakdown.peak + self.device.runtime

    @property
    def fits(self) -> bool:
        return self.needed <= self.device.available

    @property
    def clearly_too_big(self) -> bool:
        return self.needed > REFUSE_OVER * self.device.total


def make_plan(args: GRPOConfig, processes: int | None = None, device: Device | None = None, config=None,
              prompts: PromptLengths | None = None) -> Plan:
    """The plan of a run with ``args`` over ``processes`` processes (default: as launched) on ``device``
    (default: this machine's). Reads the model's config and tokenizer, never its weights (``config``: one
    already read), and the prompts' lengths where the data can be read (``prompts``: lengths measured
    already, ``covey.plan.prompts.measure_prompts``)."""
    processes = processes or int(os.environ.get("WORLD_SIZE", "1") or 1)  # as the launcher started them
    device = device or this_device(args.use_cpu, processes)
    config = config if config is not None else model_config(args.model, args.trust_remote_code, args.model_revision)
    shape = model_shape(config)
    prompts = prompts if prompts is not None else measure_prompts(args)
    settings = settings_from_config(args, shape, config, processes, device, prompts.peak_length)
    return Plan(args, config, shape, prompts, settings, estimate(shape, settings), device)


def replan(plan: Plan, processes: int | None = None, **changes) -> Plan:
    """``plan`` again with some config fields changed (and optionally over another number of processes)."""
    args = plan.args.replace(**changes)
    settings = settings_from_config(args, plan.shape, plan.config, processes or plan.settings.processes, plan.device,
                                    plan.prompts.peak_length)
    return Plan(args, plan.config, plan.shape, plan.prompts, settings, estimate(plan.shape, settings), plan.device)
