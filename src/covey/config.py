"""The one configuration object of a covey run.

Field names follow TRL's ``GRPOConfig`` wherever TRL has the concept, so a TRL config moves across
unchanged; on the command line the same names are written in dash-case (``--learning-rate``).
Every field carries a one-line help text (shown by ``covey train --help``) and is used somewhere.
The defaults are the built-in demo: the embedded SmolLM2-135M-Instruct on the ``arithmetic`` task,
sized to finish in minutes on a laptop CPU.

    >>> cfg = GRPOConfig(learning_rate=2e-5, max_steps=10)
    >>> cfg.generation_batch_size // cfg.num_generations   # prompts per step (of each process)
    2
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import inspect
import json
import math
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from covey.errors import ConfigError
from covey.sources import EMBEDDED_MODEL
from covey.trl_fields import AS_COVEY_DOES, NAMES_ELSEWHERE, SAME_AS, UNSET_WHEN_NONE, as_covey_does


def _f(default: Any, help: str, **choices: Any) -> Any:
    """A config field with its one-line help (and, optionally, the allowed values)."""
    meta = {"help": help, **choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


DTYPES = ("float32", "bfloat16", "float16", "auto")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
ENGINE_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LR_SCHEDULERS = ("constant", "linear", "cosine", "cosine_with_min_lr")
# model_init_kwargs keys that are covey fields (torch_dtype: transformers' older name of dtype)
MODEL_INIT_FIELDS = {"dtype": "dtype", "torch_dtype": "dtype", "revision": "model_revision",
                     "attn_implementation": "attn_implementation", "trust_remote_code": "trust_remote_code"}
# generation_kwargs keys (transformers', vLLM's names) that covey's own fields set
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_tokens": "max_completion_length",
                   "max_new_tokens": "max_completion_length", "stop": "stop_strings", "stop_strings": "stop_strings",
                   "n": "num_generations", "num_return_sequences": "num_generations", "seed": "seed",
                   "do_sample": "temperature (covey always samples in training)", "logprobs": "sampler's output"}
SAVE_STRATEGIES = ("steps", "epoch", "no")
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
# the demo's data and rewards (covey train with no arguments): in Python, GRPOConfig(**DEMO, ...) asks for them
DEMO = {"dataset": "arithmetic", "reward_funcs": ["answer_format", "answer_correct"]}
# fields that say how a run continues, not what it trains: a resume may change them freely
RESUME_FIELDS = ("resume_from_checkpoint", "output_dir", "overwrite_output_dir")
VESPO_SEQUENCE_CORRECTION = (
    "loss_type: vespo folds the engine/trainer importance weights into its sequence weight token by token (as TRL "
    "does), and vllm_importance_sampling_mode gives one weight per sequence; set vllm_importance_sampling_mode: "
    "token_truncate or token_mask, or vllm_importance_sampling_correction: false")
SYNC_WITH_LORA = ("sync_ref_model cannot be used with a LoRA policy (use_peft, peft_config or a model with an "
                  "adapter): its reference is the base model with the adapter disabled, not a copy to sync")


@dataclass
class GRPOConfig:
    # --- model -------------------------------------------------------------------------------
    model: str = _f(EMBEDDED_MODEL, "Hugging Face hub id, local model folder, or the embedded default model")
    trust_remote_code: bool = _f(False, "allow model code from the hub or folder to run (off unless you trust it)")
    model_revision: str = _f("main", "branch, tag or commit of the model on the hub")
    dtype: str = _f("float32", "dtype the model's weights are loaded and trained in (auto: the checkpoint's own); see bf16 for autocast", choices=DTYPES)
    attn_implementation: str | None = _f(None, "transformers' attention implementation: sdpa, eager, flash_attention_2, ... (None: transformers' choice)")
    model_init_kwargs: dict | None = _f(None, "further keyword arguments of the model's from_pretrained (a model given by name only)")
    load_in_4bit: bool = _f(False, "load the base model's weights in 4 bits through bitsandbytes (a LoRA policy only)")
    load_in_8bit: bool = _f(False, "load the base model's weights in 8 bits through bitsandbytes (a LoRA policy only)")
    bnb_4bit_quant_type: str = _f("nf4", "4-bit data type of load_in_4bit", choices=("nf4", "fp4"))
    use_bnb_nested_quant: bool = _f(False, "load_in_4bit: quantize the quantization constants too (a little less memory)")
    cast_lm_head_to_fp32: bool = _f(False, "compute the output head (the logits) in float32 whatever dtype or autocast the rest runs in")
    use_peft: bool = _f(False, "train a LoRA adapter instead of all weights")
    lora_r: int = _f(16, "LoRA rank")
    lora_alpha: int = _f(32, "LoRA scaling numerator (scale = lora_alpha / lora_r)")
    lora_dropout: float = _f(0.05, "dropout on the LoRA input (TRL's default; disable_dropout turns it off)")
    lora_target_modules: list | None = _f(None, "module names LoRA wraps ('all-linear' = every linear layer but the head; None: peft's default for the architecture)")
    lora_modules_to_save: list | None = _f(None, "modules trained in full beside the adapter, and saved with it")
    use_rslora: bool = _f(False, "rank-stabilised LoRA: scale = lora_alpha / sqrt(lora_r)")
    use_dora: bool = _f(False, "DoRA: LoRA plus a trained magnitude per output (samples with rollout_engine: fast or hf)")
    # --- data --------------------------------------------------------------------------------
    dataset: str = _f("arithmetic", "built-in task name, local JSONL/CSV/Parquet file, or Hugging Face dataset id")
    dataset_config: str | None = _f(None, "configuration (subset) of a Hugging Face dataset id, such as gsm8k's main")
    dataset_split: str = _f("train", "split to train on when `dataset` is a Hugging Face dataset id")
    eval_dataset: str | None = _f(None, "held-out data for the before/after evaluation (built-in tasks bring their own)")
    eval_split: str = _f("test", "split of eval_dataset when it is a built-in task or a Hugging Face dataset id (set train for one without a test split)")
    chat_template_kwargs: dict | None = _f(None, "variables for the chat template, such as Qwen3's enable_thinking: false (every prompt and tool message is rendered with them)")
    system_prompt: str | None = _f(None, "a system message put first in every prompt of the training and held-out data, instead of the one covey writes into built-in tasks and GSM8K-format rows (one your data has is an error)")
    eval_strategy: str = _f("no", "held-out evaluation during training too: no (before and after only), or every eval_steps optimizer steps", choices=("no", "steps"))
    eval_steps: int | None = _f(None, "optimizer steps between evaluations under eval_strategy: steps (None: logging_steps, as TRL)")
    per_device_eval_batch_size: int = _f(32, "completions generated at a time in evaluation (of each process)")
    num_generations_eval: int | None = _f(None, "evaluation samples this many completions per row as in training and averages them (None: one greedy completion)")
    eval_max_samples: int = _f(64, "held-out examples scored before and after training (0 = skip evaluation)")
    max_prompt_length: int = _f(512, "longest prompt in tokens (see prompt_overflow)")
    prompt_overflow: str = _f("truncate_left", "a longer training prompt: keep its last tokens (as TRL did; a warning says how many), drop the row, or stop with an error", choices=("truncate_left", "drop", "error"))
    seed: int = _f(42, "seed for data order, sampling and initialisation")
    shuffle_dataset: bool = _f(True, "draw the training prompts in a new seeded order every pass (false: in the dataset's order)")
    # --- rewards -----------------------------------------------------------------------------
    reward_funcs: list = _f(["answer_format", "answer_correct"], "built-in reward names, 'file.py:function' / 'package.module:function', or a reward model's hub id or folder")
    reward_weights: list | None = _f(None, "one weight per reward function (default: all 1.0)")
    reward_errors: str = _f("raise", "a reward function that raises or times out: stop the run, or score the sample None", choices=("raise", "skip"))
    reward_timeout: float | None = _f(None, "seconds one reward call may take before it counts as an error (None = no limit)")
    reward_num_workers: int = _f(0, "worker processes that run the (non-async) reward functions (0 = in the trainer's process)")
    code_timeout: float = _f(5.0, "code_tests reward: wall-clock seconds one completion's program may run")
    code_memory_limit_mb: int = _f(512, "code_tests reward: memory limit of one completion's program in MiB")
    strip_reasoning: bool = _f(False, "hand rewards only the answer after a <think>...</think> block (unterminated: empty)")
    multi_objective_aggregation: str = _f("sum_then_normalize", "combine rewards before normalising, or normalise each then sum", choices=REWARD_AGGREGATIONS)
    overlong_max_length: int | None = _f(None, "soft_overlong_penalty reward: length where the penalty reaches -1 (default: max_completion_length)")
    overlong_cache_length: int | None = _f(None, "soft_overlong_penalty reward: length of the linear ramp before it (default: a quarter of the max)")
    # --- generation --------------------------------------------------------------------------
    num_generations: int = _f(8, "completions sampled per prompt (the group size G)")
    max_completion_length: int = _f(32, "most tokens generated per completion")
    temperature: float = _f(1.0, "sampling temperature (log-probs are computed at the same temperature)")
    top_p: float = _f(1.0, "nucleus sampling: keep the smallest token set with this much probability")
    top_k: int = _f(0, "keep only the k most likely tokens (0 = off)")
    min_p: float | None = _f(None, "drop tokens less likely than min_p times the most likely one (None = off)")
    repetition_penalty: float = _f(1.0, "penalise tokens already in the prompt or the completion by this factor (1 = off)")
    generation_kwargs: dict | None = _f(None, "further settings of the sampler (rollout_engine hf: GenerationConfig's; vllm: SamplingParams'), such as presence_penalty")
    stop_strings: list | None = _f(None, "strings that end a completion (kept in it; fast and vllm engines)")
    rollout_engine: str = _f("fast", "sampler: covey's KV-cache engine, transformers generate, or vLLM", choices=("fast", "hf", "vllm"))
    use_vllm: bool = _f(False, "TRL's switch for rollout_engine: vllm")
    vllm_mode: str = _f("colocate", "vLLM in the trainer's process, or a vLLM server (vllm serve, covey server) reached over HTTP", choices=("colocate", "server"))
    vllm_server_host: str = _f("127.0.0.1", "host of the vLLM server (vllm_mode: server)")
    vllm_server_port: int = _f(8000, "port of the vLLM server (vllm_mode: server)")
    vllm_server_timeout: float = _f(240.0, "seconds to wait for the vLLM server to answer its health check")
    vllm_group_port: int = _f(0, "port of the weight-transfer group the trainer opens with the server (0: a free one)")
    vllm_enable_sleep_mode: bool = _f(False, "vllm colocate: offload vLLM's weights and free its KV cache while the trainer trains (CUDA only)")
    vllm_gpu_memory_utilization: float = _f(0.3, "fraction of GPU memory vLLM may take (on a CPU: of this machine's memory, for its KV cache)")
    mask_truncated_completions: bool = _f(False, "leave completions that hit max_completion_length out of the loss (DAPO)")
    dynamic_sampling: bool = _f(False, "drop groups whose rewards are all equal and refill the batch from new prompts (DAPO)")
    dynamic_sampling_max_rounds: int = _f(4, "most extra generation rounds per step when refilling under dynamic_sampling")
    # --- agents: tools and environments (docs/agents.md) ---------------------------------------
    tools: list = _f([], "tools the model may call over several turns: built-in names (calculate, run_python) or 'file.py:function' / 'package.module:function'")
    environment_factory: str | None = _f(None, "an environment class in TRL's convention, as 'file.py:Class': one instance per episode, reset(**row), its methods are tools")
    max_tool_calling_iterations: int | None = _f(None, "rounds of tool calls an episode may make (None: until a turn makes none or the completion budget ends it), as in TRL")
    tool_call_parser: str = _f("hermes", "how tool calls are written in the model's text: <tool_call>{json}</tool_call> (Hermes, Qwen)", choices=("hermes",))
    tool_timeout: float = _f(10.0, "seconds one tool call may take before its result is an error message for the model")
    # --- optimisation ------------------------------------------------------------------------
    learning_rate: float = _f(1e-5, "peak learning rate of AdamW")
    per_device_train_batch_size: int = _f(16, "completions per forward/backward micro-batch (of each process, as in TRL)")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    steps_per_generation: int | None = _f(None, "micro-batches per generation batch (default: gradient_accumulation_steps); a multiple gives several optimizer steps per generation")
    max_steps: int = _f(30, "optimizer steps to train for; -1: num_train_epochs passes over the training prompts instead (as in TRL)")
    num_train_epochs: float | None = _f(None, "with max_steps -1: passes over the training prompts to train for, in whole generation rounds (3 when unset, as in TRL)")
    num_iterations: int = _f(1, "passes over each generation batch (PPO epochs, mu); each pass takes "
                                "steps_per_generation / gradient_accumulation_steps optimizer steps (one by default)")
    loss_type: str = _f("dapo", "objective and token aggregation (see docs/algorithms.md)", choices=LOSS_TYPES)
    importance_sampling_level: str = _f("token", "per-token ratio, or GSPO's length-normalised sequence ratio", choices=IMPORTANCE_SAMPLING_LEVELS)
    beta: float = _f(0.0, "KL penalty coefficient towards the reference model (0 = no reference model)")
    kl_estimator: str = _f("k3", "estimator of KL(policy || reference) per token", choices=KL_ESTIMATORS)
    use_bias_correction_kl: bool = _f(True, "multiply the KL term by the importance ratio, as TRL does by default (false: the GRPO paper's plain KL term)")
    sync_ref_model: bool = _f(False, "move the reference towards the policy every ref_model_sync_steps (TR-DPO style)")
    ref_model_mixup_alpha: float = _f(0.6, "reference <- alpha * policy + (1 - alpha) * reference at each sync")
    ref_model_sync_steps: int = _f(512, "optimizer steps between reference syncs")
    epsilon: float = _f(0.2, "lower clip range of the probability ratio")
    epsilon_high: float | None = _f(None, "upper clip range (default: same as epsilon; DAPO clip-higher uses 0.28)")
    delta: float | None = _f(None, "two-sided clipping: cap on the unclipped ratio (INTELLECT-2; > 1 + epsilon_high)")
    clip_ratio_c: float | None = _f(None, "dual-clip: for negative advantages the objective never drops below c * A (c > 1)")
    sapo_temperature_pos: float = _f(1.0, "loss_type sapo: temperature of the soft gate on tokens of a positive advantage (larger: their gradient fades faster as the ratio leaves 1)")
    sapo_temperature_neg: float = _f(1.05, "loss_type sapo: temperature of the soft gate on tokens of a zero or negative advantage")
    vespo_k_pos: float = _f(2.0, "loss_type vespo: power k of the sequence weight's kernel W^k e^(lambda (1 - W)) for advantages >= 0 (larger: less weight where W < 1)")
    vespo_lambda_pos: float = _f(3.0, "loss_type vespo: decay lambda of the kernel for advantages >= 0 (larger: less weight where W > 1)")
    vespo_k_neg: float = _f(3.0, "loss_type vespo: power k of the kernel for negative advantages")
    vespo_lambda_neg: float = _f(2.0, "loss_type vespo: decay lambda of the kernel for negative advantages")
    off_policy_mask_threshold: float | None = _f(None, "leave out of the policy loss every sequence of negative advantage whose mean log-ratio of the sampling policy to the current one exceeds this (DeepSeek-V3.2's delta, e.g. 0.5; None = off)")
    top_entropy_quantile: float = _f(1.0, "train only on this top fraction of tokens by entropy (1 = all)")
    entropy_coef: float = _f(0.0, "entropy bonus: the loss subtracts this times the mean entropy of the trained tokens, for every loss_type alike (0 = off; the starting value under use_adaptive_entropy)")
    use_adaptive_entropy: bool = _f(False, "move entropy_coef by entropy_coef_delta after each optimizer step, up while the entropy is at most entropy_target and down above it, and apply it only then (Skywork-OR1)")
    entropy_target: float = _f(0.2, "use_adaptive_entropy: the mean token entropy in nats at or below which the bonus applies and grows (set it near the logged entropy early in training)")
    entropy_coef_delta: float = _f(0.005, "use_adaptive_entropy: how much entropy_coef moves after each optimizer step")
    entropy_coef_min: float = _f(0.0, "use_adaptive_entropy: the lowest entropy_coef may go")
    entropy_coef_max: float = _f(1.0, "use_adaptive_entropy: the highest entropy_coef may go")
    async_generation: bool = _f(False, "sample and score the next generation rounds in a worker thread while the trainer trains on earlier ones; each row is corrected for the policy that sampled it (docs/async.md)")
    max_staleness: int = _f(1, "async_generation: the most optimizer steps the policy that sampled a round may lag the trained one at the round's first step (whole rounds: at least the optimizer steps per round); staler rounds are dropped")
    async_schedule: str = _f("fixed", "async_generation: fixed samples each round with the weights exactly max_staleness steps (whole rounds) old, so a seeded run is reproducible; latest with the newest weights when the round starts", choices=("fixed", "latest"))
    vllm_importance_sampling_correction: bool = _f(True, "correct for the engine's sampling distribution differing from the trainer's")
    vllm_importance_sampling_mode: str = _f("sequence_mask", "how the engine/trainer ratio is applied", choices=ENGINE_IS_MODES)
    vllm_importance_sampling_clip_max: float = _f(3.0, "upper bound C_max of the engine/trainer ratio")
    vllm_importance_sampling_clip_min: float | None = _f(None, "lower bound of the engine/trainer ratio (None = none)")
    scale_rewards: str = _f("group", "divide advantages by the std of the group, of the batch, or not at all", choices=SCALE_REWARDS)
    max_grad_norm: float = _f(1.0, "clip the gradient norm to this value (0 = no clipping)")
    max_consecutive_bad_steps: int = _f(3, "stop after this many steps in a row with NaN/inf loss or gradients (each is skipped)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon")
    fsdp: str = _f("", "shard the model, its gradients and AdamW's state over the processes with FSDP2, per transformer block (TRL's words): full_shard, or shard_grad_op (a block's parameters stay gathered from its forward to its backward); '' for none")
    fsdp_config: dict | None = _f(None, "TRL's FSDP options: version (2), reshard_after_forward, transformer_layer_cls_to_wrap (the block classes; default: the model's decoder layers); others are refused unless at what covey does")
    ddp_timeout: int = _f(3600, "several processes: seconds one waits for the others at a collective, such as while the first writes a large checkpoint (TRL's default: 1800)")
    shard_optimizer_state: bool = _f(False, "several processes: each holds and updates the AdamW state of its share of the parameters only, then sends them to the others (ZeRO stage 1); no effect in one process")
    warmup_ratio: float = _f(0.0, "fraction of max_steps over which the learning rate rises linearly to its peak (the first of W warmup steps takes lr / (W + 1), never 0 as in transformers' schedules)")
    warmup_steps: float = _f(0.0, "the warmup as TRL names it: a whole number of optimizer steps, or below 1 a fraction of max_steps (instead of warmup_ratio)")
    lr_scheduler_type: str = _f("constant", "learning-rate schedule after warmup", choices=LR_SCHEDULERS)
    lr_scheduler_kwargs: dict | None = _f(None, "settings of the schedule, as transformers': cosine_with_min_lr takes min_lr_rate (a fraction of learning_rate) or min_lr")
    router_aux_loss_coef: float | None = _f(None, "mixture-of-experts models: weight of the router's load-balancing loss added to the training loss (None: the architecture's own, as TRL; 0: none)")
    use_cpu: bool = _f(False, "keep the models on the CPU even where a CUDA GPU is (as TRL)")
    bf16: bool = _f(False, "run forward passes under bfloat16 autocast (faster on recent CPUs and GPUs)")
    rollout_bf16: bool | None = _f(None, "sample in bfloat16 (fast, hf engines): faster on GPUs and AMX CPUs, log-probs then corrected (None = with bf16 or on a GPU)")
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    disable_dropout: bool = _f(False, "turn every dropout of the policy off (LoRA's included), so its log-probs are deterministic")
    keep_freed_memory: bool = _f(True, "on Linux, the C library keeps freed CPU memory for reuse while training: half the page faults, a lower peak (process-wide)")
    memory_check: bool = _f(True, "before loading the model, estimate a step's peak memory (covey plan) and refuse a run estimated at over 1.5x the device's memory (false: train anyway)")
    # --- output ------------------------------------------------------------------------------
    output_dir: str | None = _f(None, "run folder (default: runs/<date>-<time>); an existing run is never overwritten "
                                      "unless overwrite_output_dir")
    overwrite_output_dir: bool = _f(False, "allow writing into an output_dir that already holds files")
    logging_steps: int = _f(1, "write metrics every this many optimizer steps, each the mean over those steps (as TRL)")
    logging_first_step: bool = _f(False, "also write the first optimizer step's metrics on their own, whatever logging_steps says (as TRL)")
    log_level: str = _f("passive", "what transformers prints while covey runs (passive: errors only)", choices=("passive", "debug", "info", "warning", "error", "critical"))
    log_completions: bool = _f(True, "record sample completions (completions.jsonl and a console table)")
    log_completions_steps: int = _f(5, "record the completions of every this many steps (and of the first and last)")
    num_completions_to_print: int | None = _f(4, "rows of the console completions table (None: all, as TRL)")
    report_to: list = _f(["none"], "trackers that also get the metrics: tensorboard, wandb, trackio, mlflow, or none")
    project: str | None = _f(None, "Trackio's project the run is logged under (None: TRACKIO_PROJECT, else covey; TRL's default: huggingface)")
    run_name: str | None = _f(None, "the run's name in trackers (default: the run folder's name)")
    save_strategy: str = _f("steps", "when checkpoints are written: every save_steps optimizer steps, after each pass over the training prompts, or never (as TRL; the final model is always saved)", choices=SAVE_STRATEGIES)
    save_steps: int = _f(500, "save_strategy: steps writes a checkpoint every this many optimizer steps (0 = none)")
    save_total_limit: int | None = _f(2, "keep only the newest this many checkpoints (None = keep all)")
    save_only_model: bool = _f(False, "checkpoints of the model alone, without optimizer, scheduler and random states: smaller, but no run can resume from them (as TRL)")
    push_to_hub: bool = _f(False, "upload the final model, and the checkpoints as hub_strategy says, to the Hugging Face Hub (checked before training starts)")
    hub_model_id: str | None = _f(None, "the Hub repo to push to: 'name' (in your namespace) or 'org/name' (default: output_dir's folder name, as TRL)")
    hub_strategy: str = _f("every_save", "what is pushed when: the final model only, also each checkpoint's model, and the newest checkpoint as last-checkpoint/ or every checkpoint in its own folder (as TRL)", choices=HUB_STRATEGIES)
    hub_token: str | None = _f(None, "Hub token with write access (default: HF_TOKEN or the `hf auth login` one); never written to the run folder")
    hub_private_repo: bool | None = _f(None, "create the repo private (None: the namespace's default); an existing repo keeps its visibility")
    hub_revision: str | None = _f(None, "the branch of the repo to push to (None: main)")
    hub_always_push: bool = _f(False, "push every checkpoint, queued behind the upload in progress (false: a checkpoint saved while the previous push is unfinished is not pushed, as TRL)")
    resume_from_checkpoint: str | None = _f(None, "continue a run: 'auto' (newest checkpoint in output_dir) or a checkpoint folder")

    def __post_init__(self) -> None:
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        for name in ("eval_strategy", "save_strategy"):
            if getattr(self, name) is False or str(getattr(self, name)).lower() == "false":  # YAML reads an unquoted no as false
                setattr(self, name, "no")
        # older TRL configs use true/false (a YAML bool, or text from the command line)
        if isinstance(self.scale_rewards, bool) or str(self.scale_rewards).lower() in ("true", "false"):
            self.scale_rewards = "group" if str(self.scale_rewards).lower() == "true" else "none"
        if self.fsdp is None or (isinstance(self.fsdp, (list, tuple)) and all(isinstance(w, str) for w in self.fsdp)):
            self.fsdp = " ".join(self.fsdp or [])  # TRL takes a list of its words too
        problems = []  # every bad value at once
        for f in dataclasses.fields(self):
            try:
                setattr(self, f.name, _coerce(f.name, getattr(self, f.name), _field_type(f)))
            except ConfigError as e:
                problems.append(str(e))
                continue
            allowed = f.metadata.get("choices")
            if allowed and getattr(self, f.name) not in allowed:
                problems.append(f"{f.name}={getattr(self, f.name)!r} is not one of {', '.join(allowed)}")
        if problems:  # the range checks need values of the right types
            raise config_errors(problems)
        self._lift_model_init_kwargs()
        if self.use_vllm:
            self.rollout_engine = "vllm"
        self._check_ranges()

    def _lift_model_init_kwargs(self) -> None:
        """Settings of model_init_kwargs that are covey fields (TRL recipes give the dtype there) move into
        those fields, which load every model (the policy, the engines' copies); both set differently: an error."""
        if not self.model_init_kwargs:
            return
        kwargs, problems = dict(self.model_init_kwargs), []
        for key, name in MODEL_INIT_FIELDS.items():
            if key not in kwargs:
                continue
            value = kwargs.pop(key)
            value = str(value).removeprefix("torch.") if name == "dtype" else value  # torch.bfloat16 from Python
            default = GRPOConfig.__dataclass_fields__[name].default
            if getattr(self, name) not in (default, value):
                problems.append(f"model_init_kwargs sets {key}={value!r} and {name}={getattr(self, name)!r}; give one")
            else:
                setattr(self, name, _coerce(name, value, _field_type(GRPOConfig.__dataclass_fields__[name])))
        if problems:
            raise config_errors(problems)
        self.model_init_kwargs = kwargs or None
        if self.dtype not in DTYPES:
            raise ConfigError(f"model_init_kwargs: dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")

    def __getattr__(self, name: str) -> Any:
        """A TRL setting covey accepts as what it does (``optim``, ``do_eval``, ...) reads as given, or as
        TRL's default; scripts read them back."""
        if name in AS_COVEY_DOES:
            return self.__dict__.get("trl_settings", {}).get(name, AS_COVEY_DOES[name][0])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def quantization(self) -> str | None:
        """'4bit' or '8bit' (load_in_4bit, load_in_8bit), else None."""
        return "4bit" if self.load_in_4bit else "8bit" if self.load_in_8bit else None

    def _check_ranges(self) -> None:
        problems: list[str] = []

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        try:
            self._ranges(need)
        except ConfigError as e:  # a check that raises itself
            problems.extend(getattr(e, "problems", [str(e)]))
        except (ArithmeticError, TypeError, ValueError):  # a check that needs a value an earlier one refused
            if not problems:
                raise
        if problems:
            raise config_errors(problems)

    def _ranges(self, need: Callable[[bool, str], None]) -> None:
        need(self.num_generations >= 2, f"num_generations={self.num_generations}: a group needs at least 2 completions")
        spg = self.micro_batches_per_generation
        need(
            self.generation_batch_size % self.num_generations == 0,
            f"per_device_train_batch_size * {'steps_per_generation' if self.steps_per_generation else 'gradient_accumulation_steps'}"
            f" = {self.per_device_train_batch_size} * {spg} = {self.generation_batch_size} completions per generation is "
            f"not divisible by num_generations={self.num_generations}; make it a multiple so every prompt gets a whole group",
        )
        need(spg % self.gradient_accumulation_steps == 0,
             f"steps_per_generation={spg} must be a multiple of gradient_accumulation_steps={self.gradient_accumulation_steps}")
        if self.delta is not None:
            need(self.delta > 1 + (self.epsilon if self.epsilon_high is None else self.epsilon_high),
                 f"delta={self.delta} must exceed 1 + epsilon_high, or it clips every ratio")
        if self.clip_ratio_c is not None:
            need(self.clip_ratio_c > 1, f"clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip uses about 3)")
        self._check_loss_variant(need)
        if self.async_generation:
            steps = self.optimizer_steps_per_generation
            need(self.max_staleness >= steps, f"async_generation: max_staleness={self.max_staleness} is below the "
                 f"{steps} optimizer step(s) of each generation round, so no round could be sampled ahead; set "
                 f"max_staleness to {steps} (one round ahead) or more")
            need(self.vllm_importance_sampling_correction, "async_generation samples with an older policy, and "
                 "vllm_importance_sampling_correction: false turns off the correction for it; leave it on")
            need(not self.vllm_enable_sleep_mode, "async_generation: vllm_enable_sleep_mode puts vLLM to sleep "
                 "between generations, and under async_generation it samples while the trainer trains; set "
                 "vllm_enable_sleep_mode: false")
        if self.importance_sampling_level == "sequence" and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            warnings.warn(f"importance_sampling_level: sequence with loss_type: {self.loss_type}, a sum over tokens, "
                          "weights each sequence by its completion length; GSPO's per-sequence objective is "
                          "loss_type: grpo (LUSPO's length weighting on purpose: luspo)", stacklevel=3)
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            warnings.warn("loss_type: luspo weights each sequence's loss by its length, which the paper does with "
                          "the sequence-level ratio; set importance_sampling_level: sequence", stacklevel=3)
        cap = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if self.loss_type == "cispo" and cap <= 1:
            warnings.warn(f"loss_type: cispo caps each token's weight at epsilon_high={cap} itself (as TRL does), so "
                          "every weight is below the ratio 1 it starts at; the MiniMax-M1 cap is 1 + eps (TRL's docs "
                          "suggest epsilon_high: 5.0)", stacklevel=3)
        need(0 < self.top_entropy_quantile <= 1, f"top_entropy_quantile={self.top_entropy_quantile} must be in (0, 1]")
        need(0 <= self.ref_model_mixup_alpha <= 1, f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in [0, 1]")
        need(not self.sync_ref_model or self.beta > 0,
             "sync_ref_model needs beta > 0: with beta 0 there is no reference model to sync")
        need(not (self.sync_ref_model and self.use_peft), SYNC_WITH_LORA)
        need(self.vllm_importance_sampling_clip_max > 0, "vllm_importance_sampling_clip_max must be positive")
        need(self.reward_timeout is None or self.reward_timeout > 0, f"reward_timeout={self.reward_timeout} must be positive")
        need(self.max_steps >= 1 or self.max_steps == -1,
             f"max_steps={self.max_steps} must be at least 1, or -1 to train for num_train_epochs")
        epochs = "None" if self.num_train_epochs is None else f"{self.num_train_epochs:g}"
        need(self.num_train_epochs is None or self.num_train_epochs > 0,
             f"num_train_epochs={epochs} must be positive")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                     "max_completion_length", "max_prompt_length", "logging_steps", "ref_model_sync_steps",
                     "dynamic_sampling_max_rounds", "max_consecutive_bad_steps"):
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be at least 1")
        need(self.learning_rate > 0, f"learning_rate={self.learning_rate} must be positive")
        need(self.temperature > 0, f"temperature={self.temperature} must be positive (use a small value for near-greedy)")
        need(0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]")
        need(self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0 = off)")
        need(self.min_p is None or 0 <= self.min_p < 1, f"min_p={self.min_p} must be in [0, 1)")
        need(self.repetition_penalty > 0, f"repetition_penalty={self.repetition_penalty} must be positive")
        need(not (self.stop_strings and self.rollout_engine == "hf"),
             "stop_strings need rollout_engine: fast (transformers generate cannot report where they ended)")
        for key in sorted(set(self.generation_kwargs or {})):
            need(key not in SAMPLING_FIELDS, f"generation_kwargs: {key} is covey's {SAMPLING_FIELDS.get(key)}, "
                                             "which the log-probs are computed with too; set that field instead")
        need(not self.generation_kwargs or self.rollout_engine != "fast",
             f"generation_kwargs {sorted(self.generation_kwargs or {})} are settings of transformers' generate or "
             "vLLM, and rollout_engine: fast samples with covey's fields only; use rollout_engine: hf or vllm (the "
             "default with generation_kwargs), or remove them")
        need(self.beta >= 0, f"beta={self.beta} must be >= 0")
        need(self.epsilon >= 0 and (self.epsilon_high is None or self.epsilon_high >= 0), "epsilon and epsilon_high must be >= 0")
        need(0 <= self.warmup_ratio < 1, f"warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        need(0 <= self.warmup_steps and (self.warmup_steps < 1 or self.warmup_steps == int(self.warmup_steps)),
             f"warmup_steps={self.warmup_steps:g} must be a whole number of steps, or a fraction of max_steps in [0, 1)")
        need(not (self.warmup_steps and self.warmup_ratio),
             f"warmup_steps={self.warmup_steps:g} and warmup_ratio={self.warmup_ratio} both set the warmup; keep one")
        need(self.eval_max_samples >= 0, f"eval_max_samples={self.eval_max_samples} must be >= 0")
        need(self.max_grad_norm >= 0, f"max_grad_norm={self.max_grad_norm} must be >= 0")
        need(self.steps_per_generation is None or self.steps_per_generation >= 1,
             f"steps_per_generation={self.steps_per_generation} must be at least 1")
        need(self.lora_r >= 1 and self.lora_alpha > 0 and 0 <= self.lora_dropout < 1,
             f"LoRA settings out of range: lora_r={self.lora_r} (>= 1), lora_alpha={self.lora_alpha} (> 0), "
             f"lora_dropout={self.lora_dropout} (in [0, 1))")
        need(not self.use_peft or self.lora_target_modules != [],
             "lora_target_modules is empty: name the modules LoRA wraps (q_proj, v_proj, ...) or use all-linear")
        need(not (self.load_in_4bit and self.load_in_8bit), "load_in_4bit and load_in_8bit both set: choose one")
        for key, instead in (("quantization_config", "load_in_4bit or load_in_8bit"),
                             ("device_map", "use_cpu (covey places the model on its device)")):
            need(key not in (self.model_init_kwargs or {}), f"model_init_kwargs: {key} is set by covey's {instead}; "
                                                            "remove it from model_init_kwargs")
        need(abs(self.seed) < 2**62, f"seed={self.seed} is too large: give a seed below 2**62")
        if self.rollout_engine == "vllm":
            self.check_vllm_seed()
        need(not self.vllm_enable_sleep_mode or (self.rollout_engine == "vllm" and self.vllm_mode == "colocate"),
             "vllm_enable_sleep_mode puts the vLLM of vllm_mode: colocate to sleep while the trainer trains; this run "
             f"samples with rollout_engine: {self.rollout_engine}, vllm_mode: {self.vllm_mode} (a vLLM server sleeps "
             "by its own flags): set vllm_enable_sleep_mode: false")
        need(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1 and self.adam_epsilon > 0 and self.weight_decay >= 0,
             f"AdamW settings out of range: adam_beta1={self.adam_beta1}, adam_beta2={self.adam_beta2} (each in [0, 1)), "
             f"adam_epsilon={self.adam_epsilon} (> 0), weight_decay={self.weight_decay} (>= 0)")
        need(1 <= self.vllm_server_port <= 65535, f"vllm_server_port={self.vllm_server_port} must be in 1..65535")
        need(self.ddp_timeout >= 1, f"ddp_timeout={self.ddp_timeout} must be at least 1 second")
        need(self.vllm_server_timeout > 0, f"vllm_server_timeout={self.vllm_server_timeout} must be positive")
        need(0 <= self.vllm_group_port <= 65535, f"vllm_group_port={self.vllm_group_port} must be in 0..65535 (0: a free one)")
        need((self.overlong_max_length is None or self.overlong_max_length >= 1)
             and (self.overlong_cache_length is None or self.overlong_cache_length >= 1),
             "overlong_max_length and overlong_cache_length must be at least 1")
        need(self.vllm_importance_sampling_clip_min is None or self.vllm_importance_sampling_clip_min >= 0,
             f"vllm_importance_sampling_clip_min={self.vllm_importance_sampling_clip_min} must be >= 0")
        need(self.reward_num_workers >= 0, f"reward_num_workers={self.reward_num_workers} must be >= 0")
        need(self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 1,
             f"max_tool_calling_iterations={self.max_tool_calling_iterations} must be at least 1 (None: no limit)")
        need(self.tool_timeout > 0, f"tool_timeout={self.tool_timeout} must be positive")
        need(self.code_timeout > 0 and self.code_memory_limit_mb >= 16,
             "code_timeout must be positive and code_memory_limit_mb at least 16")
        need(self.per_device_eval_batch_size >= 1 and (self.num_generations_eval or 1) >= 1,
             "per_device_eval_batch_size and num_generations_eval must be at least 1")
        need(self.eval_steps is None or self.eval_steps >= 1, f"eval_steps={self.eval_steps} must be at least 1")
        need(self.eval_strategy == "no" or self.eval_max_samples != 0,
             "eval_strategy: steps evaluates on held-out rows, and eval_max_samples: 0 takes none; give eval_max_samples "
             "> 0 or set eval_strategy: no")
        kwargs = self.lr_scheduler_kwargs or {}
        if self.lr_scheduler_type == "cosine_with_min_lr":
            need(len(kwargs) == 1 and set(kwargs) <= {"min_lr_rate", "min_lr"},
                 f"lr_scheduler_type: cosine_with_min_lr needs lr_scheduler_kwargs with one of min_lr_rate (a fraction "
                 f"of learning_rate) or min_lr, as in transformers; got {kwargs}")
            need(all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in kwargs.values()),
                 f"lr_scheduler_kwargs {kwargs}: the floor must be a number >= 0")
        else:
            need(not kwargs, f"lr_scheduler_kwargs {kwargs} has no meaning for lr_scheduler_type: "
                             f"{self.lr_scheduler_type}; remove it")
        need(self.save_steps >= 0, f"save_steps={self.save_steps} must be >= 0 (0 = no checkpoints)")
        need(self.save_total_limit is None or self.save_total_limit >= 1,
             f"save_total_limit={self.save_total_limit} must be at least 1 (None keeps all)")
        need(self.log_completions_steps >= 1 and (self.num_completions_to_print or 0) >= 0,
             "log_completions_steps must be at least 1 and num_completions_to_print >= 0")
        need(0 < self.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization must be in (0, 1]")
        trackers = {"tensorboard", "wandb", "trackio", "mlflow", "none"}
        unknown = [t for t in self.report_to if t not in trackers]
        need(not unknown, f"report_to: {', '.join(map(repr, unknown))} is not a tracker; choose from "
                          f"{', '.join(sorted(trackers))}")
        need(len(self.reward_funcs) >= 1, "reward_funcs is empty: name at least one reward function")

    def _check_loss_variant(self, need: Callable[[bool, str], None]) -> None:
        """The settings of the objectives that replace the clipped surrogate, and of the entropy bonus:
        each in range, none given where nothing would read it."""
        own_weight = {"cispo": "it caps its own weight at epsilon_high",
                      "sapo": "its soft gate, shaped by sapo_temperature_pos/neg, replaces the clip",
                      "vespo": "its sequence weight, shaped by vespo_k_*/vespo_lambda_*, replaces the clip"}
        if self.loss_type in own_weight:
            for name in ("delta", "clip_ratio_c") + (("epsilon_high",) if self.loss_type != "cispo" else ()):
                need(getattr(self, name) is None,
                     f"{name} clips the PPO ratio, which loss_type: {self.loss_type} does not use "
                     f"({own_weight[self.loss_type]}); unset {name} or choose another loss_type")
        need(self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0,
             f"sapo_temperature_pos={self.sapo_temperature_pos} and sapo_temperature_neg={self.sapo_temperature_neg} "
             "must be positive")
        need(min(self.vespo_k_pos, self.vespo_k_neg, self.vespo_lambda_pos, self.vespo_lambda_neg) >= 0,
             f"vespo_k_pos={self.vespo_k_pos}, vespo_k_neg={self.vespo_k_neg}, vespo_lambda_pos={self.vespo_lambda_pos} "
             f"and vespo_lambda_neg={self.vespo_lambda_neg} must be >= 0")
        need(self.loss_type != "vespo" or self.importance_sampling_level == "token",
             "loss_type: vespo weighs each sequence by its own importance weight, computed from the token ratios: "
             "importance_sampling_level: sequence has no meaning for it; set importance_sampling_level: token")
        if self.loss_type == "vespo" and self.rollout_engine == "vllm" and self.vllm_importance_sampling_correction:
            need(self.vllm_importance_sampling_mode.startswith("token"), VESPO_SEQUENCE_CORRECTION)
        need(self.off_policy_mask_threshold is None or self.off_policy_mask_threshold > 0,
             f"off_policy_mask_threshold={self.off_policy_mask_threshold} must be positive (None: no off-policy mask)")
        need(self.entropy_coef >= 0, f"entropy_coef={self.entropy_coef} must be >= 0 (an entropy bonus; 0 = off)")
        need(0 <= self.entropy_coef_min <= self.entropy_coef_max,
             f"entropy_coef_min={self.entropy_coef_min} and entropy_coef_max={self.entropy_coef_max} must satisfy "
             "0 <= entropy_coef_min <= entropy_coef_max")
        need(self.entropy_coef_delta > 0 and self.entropy_target >= 0,
             f"entropy_coef_delta={self.entropy_coef_delta} must be positive and entropy_target={self.entropy_target} "
             ">= 0")
        # a setting of a variant the run does not use would be ignored: refused instead
        unused = [(("sapo_temperature_pos", "sapo_temperature_neg"), self.loss_type == "sapo", "loss_type: sapo"),
                  (("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), self.loss_type == "vespo",
                   "loss_type: vespo"),
                  (("entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max"),
                   self.use_adaptive_entropy, "use_adaptive_entropy: true")]
        for names, used, needs in unused:
            for name in names:
                value = getattr(self, name)
                need(used or value == _DEFAULTS[name],
                     f"{name}={value} has an effect only with {needs}; set that, or remove {name}")

    def sample_in_bf16(self, device: Any) -> bool:
        """Whether the local engines sample in bfloat16 on ``device`` (see rollout_bf16)."""
        if self.rollout_bf16 is not None:
            return self.rollout_bf16
        return self.bf16 or getattr(device, "type", str(device)) == "cuda"

    @property
    def micro_batches_per_generation(self) -> int:
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def generation_batch_size(self) -> int:
        """Completions sampled per generation round by each process (prompts per round = this /
        num_generations; several processes sample as many each)."""
        return self.per_device_train_batch_size * self.micro_batches_per_generation

    def prompts_per_round(self, processes: int = 1) -> int:
        """Prompts drawn for one generation round, over all ``processes``."""
        return self.generation_batch_size // self.num_generations * processes

    def steps_for_epochs(self, prompts: int, processes: int = 1) -> int:
        """The optimizer steps of num_train_epochs (3 when unset) passes over ``prompts`` training prompts,
        in whole generation rounds: the max_steps that -1 stands for."""
        rounds = math.ceil((self.num_train_epochs or 3.0) * prompts / self.prompts_per_round(processes))
        return max(1, rounds * self.optimizer_steps_per_generation)

    @property
    def warmup_optimizer_steps(self) -> int:
        """Optimizer steps of linear warmup, from warmup_steps or warmup_ratio."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil((self.warmup_steps or self.warmup_ratio) * self.max_steps)

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Optimizer steps taken on each generation batch, over all its iterations."""
        return self.micro_batches_per_generation // self.gradient_accumulation_steps * self.num_iterations

    def check_vllm_seed(self) -> None:
        """vLLM seeds numpy with ``seed``, which takes 0 to 2**32 - 1 only."""
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed={self.seed}: vLLM takes seeds from 0 to 2**32 - 1 (numpy's range); give one there")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> "GRPOConfig":
        """The config of ``values`` (``source`` names where they came from); every unknown key and bad
        value is said at once, in one ConfigError. The same door as ``GRPOConfig(**values)``."""
        try:
            config = cls(**values)
        except ConfigError as e:
            raise config_errors(getattr(e, "problems", [str(e)]), source) from None
        except TypeError as e:  # a key that is no name (a number in YAML) cannot be a keyword
            raise config_errors([f"config keys must be field names such as learning_rate: {e}"], source) from None
        # a config file or command line is a whole run: its data and rewards default to the demo's
        config.__dict__["fields_given"] = config.fields_given | {"dataset", "reward_funcs"}
        return config

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "GRPOConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start} cannot be decoded); save it as UTF-8") from None
        try:
            values = yaml.load(text, Loader=_YAMLLoader) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
            problem = getattr(e, "problem", None) or e
            if isinstance(e, yaml.reader.ReaderError):  # a forbidden character: a position, no mark
                mark = yaml.Mark(str(path), e.position, text.count("\n", 0, e.position),
                                 e.position - text.rfind("\n", 0, e.position) - 1, None, None)
                problem = f"the character {e.character!r} is not allowed in YAML"
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
        except RecursionError:
            raise ConfigError(f"{path}: invalid YAML: nested too deeply to read") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys to values, got {type(values).__name__}")
        return cls.from_dict({**values, **(overrides or {})}, source=str(path))


def covey_names(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """TRL's names and rules turned into covey's fields: (covey's fields, the TRL settings accepted as what
    covey does anyway, the problems). Both doors (Python's ``GRPOConfig(...)``, and YAML and the command
    line through ``from_dict``) pass here, so a setting is accepted or refused alike in each."""
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    problems: list[str] = []
    if "bf16" in values and values["bf16"] is None:  # TRL's None: bf16 where the GPU has it, unless use_cpu
        values = {**values, "bf16": not values.get("use_cpu") and torch_cuda_bf16()}
    for alias, name in SAME_AS.items():  # TRL's model and script arguments
        if alias in values and values[alias] is None and alias in UNSET_WHEN_NONE:  # an older name left unset
            values = {k: v for k, v in values.items() if k != alias}
        if alias in values:
            if name in values and values[name] != values[alias]:
                problems.append(f"{alias}={values[alias]!r} and {name}={values[name]!r} name the same setting "
                                "(TRL's name and covey's); give one")
            values = {**{k: v for k, v in values.items() if k != alias}, name: values[alias]}
    if "generation_batch_size" in values:  # TRL's field; covey's is computed from steps_per_generation
        values, problem = _generation_batch_as_steps(values)
        problems.extend(problem)
    if (url := values.get("vllm_server_base_url")) is not None:  # TRL's one-field form of host and port
        values, problem = _server_url_as_host_and_port(values, url)
        problems.extend(problem)
    elif "vllm_server_base_url" in values:  # None: TRL's default, host and port say where
        values = {k: v for k, v in values.items() if k != "vllm_server_base_url"}
    if "dataset_test_split" in values:  # TRL's script: the held-out split of the training dataset
        if values.get("eval_split", values["dataset_test_split"]) != values["dataset_test_split"]:
            problems.append(f"dataset_test_split={values['dataset_test_split']!r} and eval_split="
                            f"{values['eval_split']!r} name the same setting (TRL's name and covey's); give one")
        values = {k: v for k, v in values.items() if k != "dataset_test_split"} | {
            "eval_split": values["dataset_test_split"], "eval_dataset": values.get("eval_dataset") or values.get(
                "dataset", GRPOConfig.__dataclass_fields__["dataset"].default)}
    if values.get("generation_kwargs"):  # sampler settings that are covey's fields move there
        values, problem = _lift_generation_kwargs(values)
        problems.extend(problem)
    if values.get("num_train_epochs") is not None and "max_steps" not in values:
        values = {**values, "max_steps": -1}  # TRL's rule: the epochs set the length unless max_steps is given
    elif values.get("num_train_epochs") is not None and str(values["max_steps"]).strip() != "-1":
        warnings.warn(f"num_train_epochs={values['num_train_epochs']} has no effect: max_steps="
                      f"{values['max_steps']} sets the run's length (as in TRL)", stacklevel=3)
        values = {**values, "num_train_epochs": None}
    accepted = {}
    for key in values:
        if not isinstance(key, str):
            problems.append(f"config key {key!r} is not a name; keys are field names such as learning_rate")
        elif key in known:
            continue
        elif as_covey_does(key, values[key]):
            accepted[key] = values[key]
        elif key in AS_COVEY_DOES:
            problems.append(f"{key}: {values[key]!r} is a TRL setting covey does not support (covey works as "
                            f"{key}: {' or '.join(map(repr, AS_COVEY_DOES[key]))}); remove it")
        else:
            problems.append(f"unknown config key {key!r}{suggest_field(key)}")
    return {key: value for key, value in values.items() if key in known}, accepted, problems


_dataclass_init = GRPOConfig.__init__  # the dataclass's own: covey's fields only


def _init_with_trl_names(self: GRPOConfig, *output_dir: Any, **values: Any) -> None:
    """``GRPOConfig(...)`` takes what TRL's takes: covey's fields, TRL's names for them, and every TRL and
    TrainingArguments field at a value that describes what covey does (kept in ``trl_settings``); any
    other is refused with every problem at once. One positional argument is output_dir, as in TRL."""
    if output_dir:
        if len(output_dir) > 1 or "output_dir" in values:
            raise ConfigError("GRPOConfig takes one positional argument, output_dir (as TRL's); give the others "
                              "by name, such as GRPOConfig(output_dir='runs/a', learning_rate=1e-5)")
        values = {"output_dir": output_dir[0], **values}
    fields, accepted, problems = covey_names(values)
    try:
        _dataclass_init(self, **fields)
    except ConfigError as e:
        problems.extend(getattr(e, "problems", [str(e)]))
    if problems:
        raise config_errors(problems)
    self.__dict__["trl_settings"] = accepted
    self.__dict__["fields_given"] = frozenset(fields)  # what the caller set, not left at covey's default


_init_with_trl_names.__signature__ = inspect.signature(_dataclass_init).replace(  # for help() and editors
    parameters=[*inspect.signature(_dataclass_init).parameters.values(),
                inspect.Parameter("trl_settings", inspect.Parameter.VAR_KEYWORD)])
GRPOConfig.__init__ = _init_with_trl_names


class AsyncGRPOConfig(GRPOConfig):
    """TRL's ``AsyncGRPOConfig`` (stable from TRL 1.18): a GRPOConfig whose generation runs ahead of
    training (``async_generation``, docs/async.md), sampled by a vLLM server (``vllm_server_base_url``),
    with TRL's defaults for those; its settings of TRL's own asynchronous machinery are accepted at TRL's
    defaults. Any field can still be set, as in GRPOConfig."""

    DEFAULTS = {"async_generation": True, "use_vllm": True, "vllm_mode": "server", "max_staleness": 4}

    def __init__(self, *output_dir: Any, **values: Any) -> None:
        super().__init__(*output_dir, **{**self.DEFAULTS, **values})
        self.__dict__["fields_given"] = self.fields_given - (set(self.DEFAULTS) - set(values))


# generation_kwargs keys that covey's own fields set (the log-probs are computed with them too)
LIFTED_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_tokens": "max_completion_length",
                        "max_new_tokens": "max_completion_length", "stop": "stop_strings",
                        "stop_strings": "stop_strings", "n": "num_generations", "num_return_sequences": "num_generations"}


def _lift_generation_kwargs(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """generation_kwargs as TRL scripts write them: the keys that are covey fields set those fields (both
    set differently: an error), do_sample: true is what covey does; the rest stay for a sampler that
    takes them, which is transformers' generate unless the config names an engine."""
    kwargs, problems = values["generation_kwargs"], []
    if isinstance(kwargs, str):  # the command line gives JSON
        try:
            kwargs = json.loads(kwargs)
        except ValueError:
            return values, []  # the field's own check says what is wrong
    if not isinstance(kwargs, dict):
        return values, []
    kwargs = dict(kwargs)
    lifted = {}
    for key, name in LIFTED_SAMPLING_KEYS.items():
        if key in kwargs:
            value = kwargs.pop(key)
            if name in values and values[name] != value or lifted.get(name, value) != value:
                problems.append(f"generation_kwargs sets {key}={value!r} and {name}={values.get(name, lifted.get(name))!r}; "
                                "give one")
            lifted[name] = value
    if kwargs.get("do_sample") is True:
        kwargs.pop("do_sample")  # covey always samples in training
    values = {**values, **lifted, "generation_kwargs": kwargs or None}
    if kwargs and "rollout_engine" not in values and not values.get("use_vllm"):
        values["rollout_engine"] = "hf"  # the fast engine samples with covey's fields only
    return values, problems


def torch_cuda_bf16() -> bool:
    """Whether a CUDA GPU that computes in bfloat16 is here (TRL's bf16=None turns bf16 on there)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _generation_batch_as_steps(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """TRL's generation_batch_size (completions per generation over all the launched processes) as covey's
    steps_per_generation."""
    size = values["generation_batch_size"]
    values = {k: v for k, v in values.items() if k != "generation_batch_size"}
    if size is None or str(size).lower() in ("none", "null"):
        return values, []
    processes = int(os.environ.get("WORLD_SIZE", "1") or 1)  # as the launcher started them, as TRL counts
    try:
        size, per_device = int(size), int(values.get("per_device_train_batch_size",
                                                     GRPOConfig.__dataclass_fields__["per_device_train_batch_size"].default))
    except (TypeError, ValueError):
        return values, [f"generation_batch_size={size!r} is not a whole number"]
    per_step = per_device * processes
    steps = size // per_step if size >= per_step and size % per_step == 0 else None
    if steps is None:
        return values, [f"generation_batch_size={size} must be a multiple of per_device_train_batch_size * processes "
                        f"= {per_device} * {processes} (it is that times steps_per_generation, as in TRL)"]
    given = values.get("steps_per_generation")
    if given is not None and str(given).lower() not in ("none", "null") and int(given) != steps:
        return values, [f"generation_batch_size={size} and steps_per_generation={given} disagree (with "
                        f"per_device_train_batch_size={per_device} and {processes} process(es), it means "
                        f"steps_per_generation={steps}); give one"]
    return {**values, "steps_per_generation": steps}, []


def _server_url_as_host_and_port(values: dict[str, Any], url: str) -> tuple[dict[str, Any], list[str]]:
    """TRL's vllm_server_base_url ('http://host:port') as covey's vllm_server_host and vllm_server_port."""
    from urllib.parse import urlsplit

    values = {k: v for k, v in values.items() if k != "vllm_server_base_url"}
    parts = urlsplit(str(url))
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        return values, [f"vllm_server_base_url={url!r}: covey reaches a server as http://HOST:PORT (vllm_server_host "
                        "and vllm_server_port)"]
    moved = {"vllm_server_host": parts.hostname, "vllm_server_port": port or 80}
    clash = [f"vllm_server_base_url={url!r} and {k}={values[k]!r} disagree; give one" for k, v in moved.items()
             if k in values and str(values[k]) != str(v)]
    return {**values, **moved}, clash

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.default is not dataclasses.MISSING}


class _YAMLLoader(yaml.SafeLoader):
    """yaml's safe loader, reporting a value its tag cannot hold (a date such as 2024-02-30,
    '!!int x') with its line and column, like every other YAML error."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as e:
            raise yaml.constructor.ConstructorError(None, None, str(e), node.start_mark) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """A key given twice is an error, not silently the last one."""
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *defaults' merges, it is no key
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):  # left for the constructor to report
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice (first at line {seen[key].start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep)


def config_errors(problems: list[str], source: str | None = None) -> ConfigError:
    """One error saying every problem of a config (``source``: where it came from); the list stays
    on it as ``problems``."""
    where = f"{source}: " if source else ""
    error = ConfigError(where + problems[0] if len(problems) == 1 else
                        f"{where}{len(problems)} problems:\n- " + "\n- ".join(problems))
    error.problems = problems
    return error


def _did_you_mean(name: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


@functools.cache  # resolving the annotations is slow, and every config resolves every field
def _field_type(f: dataclasses.Field) -> tuple[type, bool]:
    """(base type, optional) of a field, from its annotation string."""
    hint = typing.get_type_hints(GRPOConfig)[f.name]
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if isinstance(hint, types.UnionType) else hint
    return typing.get_origin(base) or base, optional


def _coerce(name: str, value: Any, kind: tuple[type, bool]) -> Any:
    """``value`` as the field's type, parsing strings (the command line gives only strings). A bool
    is no number or text (a number or a YAML date is fine as text), numbers are finite, and list items
    are strings (numbers for reward_weights)."""
    base, optional = kind
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{name} must not be empty")
    if base is dict and isinstance(value, str):  # the command line: JSON
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not a JSON object") from None
    if base is list:
        items = value if isinstance(value, (list, tuple)) else [value]
        item_kind = (float if name == "reward_weights" else str, False)
        return [_coerce(f"{name}[{i}]", item, item_kind) for i, item in enumerate(items)]
    try:
        if base is bool:
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
                return value.lower() in ("true", "1", "yes")
            if not isinstance(value, bool):
                raise ValueError
            return value
        if isinstance(value, bool) or (base is str and not isinstance(value, (str, int, float, datetime.date))):
            raise TypeError
        if base is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        coerced = base(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name}={value!r} is not a valid {base.__name__}") from None
    if base is float and not math.isfinite(coerced):
        raise ConfigError(f"{name}={value!r} is not a finite number")
    return coerced


def config_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(GRPOConfig))


# names other tools use for a field, suggested before any spelling match
def suggest_field(name: str) -> str:
    """What to say after an unknown key ``name``: covey's field for what other trainers call so, else the
    closest field name (or nothing)."""
    if name in NAMES_ELSEWHERE:
        return f" (covey's name for it: {NAMES_ELSEWHERE[name]})"
    return _did_you_mean(name, [f.name for f in config_fields()])
