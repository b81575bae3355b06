"""The fields of covey's run config, each with its one-line help, and what follows from them alone.

``RunSettings`` is what ``covey.config.GRPOConfig`` is made of: the settings, their defaults and allowed
values, and the sizes that follow from them (prompts per round, optimizer steps per generation, ...). It
does no checking of its own: ``GRPOConfig`` reads its values in (TRL's names, YAML, the command line) and
checks them against ``covey.rules``, whose rules read these fields. Keeping the fields here lets the rules
name the type they read while the config imports the rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from covey import core
from covey.sources import EMBEDDED_MODEL


def _f(default: Any, help: str, **choices: Any) -> Any:
    """A config field with its one-line help (and, optionally, the allowed values)."""
    meta = {"help": help, **choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _script(default: Any, help: str, **choices: Any) -> Any:
    """A setting TRL keeps outside its GRPOConfig, in ``ModelConfig`` or the script's ``ScriptArguments``:
    ``GRPOConfig(...)``, YAML and covey's command line take it as any field, while an argument parser built
    on dataclasses (TRL's ``TrlParser``) leaves it to those classes, which define the same option."""
    made = _f(default, help, **choices)
    made.init = False
    return made


DTYPES = ("float32", "bfloat16", "float16", "auto")
LOSS_TYPES = tuple(core.LOSS_TYPES)
SCALE_REWARDS = tuple(core.REWARD_SCALES)
IMPORTANCE_SAMPLING_LEVELS = tuple(core.IMPORTANCE_LEVELS)
KL_ESTIMATORS = tuple(core.KL_ESTIMATORS)
REWARD_AGGREGATIONS = tuple(core.REWARD_AGGREGATIONS)
ENGINE_IS_MODES = core.ENGINE_CORRECTION_MODES
LR_SCHEDULERS = ("constant", "linear", "cosine", "cosine_with_min_lr")
SAVE_STRATEGIES = ("steps", "epoch", "no")
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")


@dataclass
class RunSettings:
    """Every setting of a run (see ``GRPOConfig``, which reads and checks them)."""

    # --- model -------------------------------------------------------------------------------
    model: str = _script(EMBEDDED_MODEL, "Hugging Face hub id, local model folder, or the embedded default model")
    trust_remote_code: bool = _f(False, "allow model code from the hub or folder to run (off unless you trust it)")
    model_revision: str = _script("main", "branch, tag or commit of the model on the hub")
    dtype: str = _script("float32", "dtype the model's weights are loaded and trained in (auto: the checkpoint's own); see bf16 for autocast", choices=DTYPES)
    attn_implementation: str | None = _script(None, "transformers' attention implementation: sdpa, eager, flash_attention_2, ... (None: transformers' choice)")
    model_init_kwargs: dict[str, Any] | str | None = _f(None, "further keyword arguments of the model's from_pretrained (a model given by name only)")
    load_in_4bit: bool = _script(False, "load the base model's weights in 4 bits through bitsandbytes (a LoRA policy only)")
    load_in_8bit: bool = _script(False, "load the base model's weights in 8 bits through bitsandbytes (a LoRA policy only)")
    bnb_4bit_quant_type: str = _script("nf4", "4-bit data type of load_in_4bit", choices=("nf4", "fp4"))
    use_bnb_nested_quant: bool = _script(False, "load_in_4bit: quantize the quantization constants too (a little less memory)")
    cast_lm_head_to_fp32: bool = _f(False, "compute the output head (the logits) in float32 whatever dtype or autocast the rest runs in")
    use_peft: bool = _script(False, "train a LoRA adapter instead of all weights")
    lora_r: int = _script(16, "LoRA rank")
    lora_alpha: int = _script(32, "LoRA scaling numerator (scale = lora_alpha / lora_r)")
    lora_dropout: float = _script(0.05, "dropout on the LoRA input (TRL's default; disable_dropout turns it off)")
    lora_target_modules: list[str] | None = _script(None, "module names LoRA wraps ('all-linear' = every linear layer but the head; None: peft's default for the architecture)")
    lora_modules_to_save: list[str] | None = _script(None, "modules trained in full beside the adapter, and saved with it")
    use_rslora: bool = _script(False, "rank-stabilised LoRA: scale = lora_alpha / sqrt(lora_r)")
    use_dora: bool = _script(False, "DoRA: LoRA plus a trained magnitude per output (samples with rollout_engine: fast or hf)")
    train_vision_tower: bool = _f(False, "a vision-language model: train its vision tower and projector too (LoRA adapters on them, or their full weights); by default only the language model trains")
    # --- data --------------------------------------------------------------------------------
    dataset: str = _script("arithmetic", "built-in task name, local JSONL/CSV/Parquet file, or Hugging Face dataset id")
    dataset_config: str | None = _script(None, "configuration (subset) of a Hugging Face dataset id, such as gsm8k's main")
    dataset_split: str = _script("train", "split to train on when `dataset` is a Hugging Face dataset id")
    eval_dataset: str | None = _f(None, "held-out data for the before/after evaluation (built-in tasks bring their own)")
    eval_split: str = _f("test", "split of eval_dataset when it is a built-in task or a Hugging Face dataset id (set train for one without a test split)")
    chat_template_kwargs: dict[str, Any] | str | None = _f(None, "variables for the chat template, such as Qwen3's enable_thinking: false (every prompt and tool message is rendered with them)")
    system_prompt: str | None = _f(None, "a system message put first in every prompt of the training and held-out data, instead of the one covey writes into built-in tasks and GSM8K-format rows (one your data has is an error)")
    eval_strategy: str = _f("no", "held-out evaluation during training too: no (before and after only), or every eval_steps optimizer steps", choices=("no", "steps"))
    eval_steps: int | None = _f(None, "optimizer steps between evaluations under eval_strategy: steps (None: logging_steps, as TRL)")
    per_device_eval_batch_size: int = _f(8, "completions generated at a time in evaluation (of each process)")
    num_generations_eval: int | None = _f(None, "evaluation samples this many completions per row as in training and averages them (None: one greedy completion)")
    eval_max_samples: int = _f(64, "held-out examples scored before and after training (0 = skip evaluation)")
    max_prompt_length: int = _f(512, "longest prompt in tokens (see prompt_overflow)")
    prompt_overflow: str = _f("truncate_left", "a longer training prompt: keep its last tokens (as TRL did; a warning says how many), drop the row, or stop with an error", choices=("truncate_left", "drop", "error"))
    seed: int = _f(42, "seed for data order, sampling and initialisation")
    shuffle_dataset: bool = _f(True, "draw the training prompts in a new seeded order every pass (false: in the dataset's order)")
    # --- rewards -----------------------------------------------------------------------------
    reward_funcs: list[str] = _script(["answer_format", "answer_correct"], "built-in reward names, 'file.py:function' / 'package.module:function', or a reward model's hub id or folder")
    reward_weights: list[float] | None = _f(None, "one weight per reward function (default: all 1.0)")
    reward_errors: str = _f("raise", "a reward function that raises or times out: stop the run, or score the sample None", choices=("raise", "skip"))
    reward_timeout: float | None = _f(None, "seconds one reward call may take before it counts as an error (None = no limit)")
    reward_num_workers: int = _f(0, "worker processes that run the (non-async) reward functions (0 = in the trainer's process)")
    reward_probes: bool = _f(True, "before the first step, warn of a reward that scores completions built to cheat it as high as a correct answer (docs/verify.md)")
    code_timeout: float = _f(5.0, "code_tests reward: wall-clock seconds one completion's program may run")
    code_memory_limit_mb: int = _f(512, "code_tests reward: memory limit of one completion's program in MiB")
    strip_reasoning: bool = _f(False, "hand rewards only the answer after a <think>...</think> block (unterminated: empty)")
    multi_objective_aggregation: str = _f("sum_then_normalize", "combine rewards before normalising, or normalise each then sum", choices=REWARD_AGGREGATIONS)
    overlong_max_length: int | None = _f(None, "soft_overlong_penalty reward: length where the penalty reaches -1 (default: max_completion_length)")
    overlong_cache_length: int | None = _f(None, "soft_overlong_penalty reward: length of the linear ramp before it (default: a quarter of the max)")
    # --- generation --------------------------------------------------------------------------
    num_generations: int = _f(8, "completions sampled per prompt (the group size G)")
    max_completion_length: int = _f(512, "most tokens generated per completion")
    temperature: float = _f(1.0, "sampling temperature (log-probs are computed at the same temperature)")
    top_p: float = _f(1.0, "nucleus sampling: keep the smallest token set with this much probability")
    top_k: int = _f(0, "keep only the k most likely tokens (0 = off)")
    min_p: float | None = _f(None, "drop tokens less likely than min_p times the most likely one (None = off)")
    repetition_penalty: float = _f(1.0, "penalise tokens already in the prompt or the completion by this factor (1 = off)")
    generation_kwargs: dict[str, Any] | str | None = _f(None, "further settings of the sampler (rollout_engine hf: GenerationConfig's; vllm: SamplingParams'), such as presence_penalty")
    stop_strings: list[str] | None = _f(None, "strings that end a completion (kept in it; fast and vllm engines)")
    rollout_engine: str = _f("fast", "sampler: covey's KV-cache engine, transformers generate, or vLLM", choices=("fast", "hf", "vllm"))
    use_vllm: bool = _f(False, "TRL's switch for rollout_engine: vllm")
    vllm_mode: str = _f("colocate", "vLLM in the trainer's process, or a vLLM server (vllm serve, covey server) reached over HTTP", choices=("colocate", "server"))
    vllm_server_host: str = _f("0.0.0.0", "host of the vLLM server (vllm_mode: server)")
    vllm_server_port: int = _f(8000, "port of the vLLM server (vllm_mode: server)")
    vllm_server_timeout: float = _f(240.0, "seconds to wait for the vLLM server to answer its health check "
                                           "(at start, and when lost mid-run)")
    vllm_group_port: int = _f(0, "port of the weight-transfer group the trainer opens with the server (0: a free one)")
    vllm_enable_sleep_mode: bool = _f(False, "vllm colocate: offload vLLM's weights and free its KV cache while the trainer trains (CUDA only)")
    vllm_gpu_memory_utilization: float = _f(0.3, "fraction of GPU memory vLLM may take (on a CPU: of this machine's memory, for its KV cache)")
    mask_truncated_completions: bool = _f(False, "leave completions that hit max_completion_length out of the loss (DAPO)")
    dynamic_sampling: bool = _f(False, "drop groups whose rewards are all equal and refill the batch from new prompts (DAPO)")
    dynamic_sampling_max_rounds: int = _f(4, "most extra generation rounds per step when refilling under dynamic_sampling")
    # --- agents: tools and environments (docs/agents.md) ---------------------------------------
    tools: list[str] = _f([], "tools the model may call over several turns: built-in names (calculate, run_python) or 'file.py:function' / 'package.module:function'")
    environment_factory: str | None = _f(None, "an environment class in TRL's convention, as 'file.py:Class': one instance per episode, reset(**row), its methods are tools")
    max_tool_calling_iterations: int | None = _f(None, "rounds of tool calls an episode may make (None: until a turn makes none or the completion budget ends it), as in TRL")
    tool_call_parser: str = _f("hermes", "how tool calls are written in the model's text: <tool_call>{json}</tool_call> (Hermes, Qwen)", choices=("hermes",))
    tool_timeout: float = _f(10.0, "seconds one tool call may take before its result is an error message for the model")
    # --- optimisation ------------------------------------------------------------------------
    learning_rate: float = _f(1e-6, "peak learning rate of AdamW")
    per_device_train_batch_size: int = _f(8, "completions per forward/backward micro-batch (of each process, as in TRL)")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    steps_per_generation: int | None = _f(None, "micro-batches per generation batch (default: gradient_accumulation_steps); a multiple gives several optimizer steps per generation")
    max_steps: int = _f(-1, "optimizer steps to train for; -1: num_train_epochs passes over the training prompts instead (as in TRL)")
    num_train_epochs: float | None = _f(3.0, "with max_steps -1: passes over the training prompts to train for, in whole generation rounds")
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
    fsdp_config: dict[str, Any] | str | None = _f(None, "TRL's FSDP options: version (2), reshard_after_forward, transformer_layer_cls_to_wrap (the block classes; default: the model's decoder layers); others are refused unless at what covey does")
    ddp_timeout: int = _f(1800, "several processes: seconds one waits for the others at a collective, such as while the first writes a large checkpoint")
    shard_optimizer_state: bool = _f(False, "several processes: each holds and updates the AdamW state of its share of the parameters only, then sends them to the others (ZeRO stage 1); no effect in one process")
    warmup_ratio: float = _f(0.0, "fraction of max_steps over which the learning rate rises linearly to its peak (the first of W warmup steps takes lr / (W + 1), never 0 as in transformers' schedules)")
    warmup_steps: float = _f(0.0, "the warmup as TRL names it: a whole number of optimizer steps, or below 1 a fraction of max_steps (instead of warmup_ratio)")
    lr_scheduler_type: str = _f("linear", "learning-rate schedule after warmup", choices=LR_SCHEDULERS)
    lr_scheduler_kwargs: dict[str, Any] | str | None = _f(None, "settings of the schedule, as transformers': cosine_with_min_lr takes min_lr_rate (a fraction of learning_rate) or min_lr")
    router_aux_loss_coef: float | None = _f(None, "mixture-of-experts models: weight of the router's load-balancing loss added to the training loss (None: the architecture's own, as TRL; 0: none)")
    use_cpu: bool = _f(False, "keep the models on the CPU even where a CUDA GPU is (as TRL)")
    bf16: bool | None = _f(None, "run forward passes under bfloat16 autocast (faster on recent CPUs and GPUs; None: on a CUDA GPU that has it, unless use_cpu, as TRL)")
    rollout_bf16: bool | None = _f(None, "sample in bfloat16 (fast, hf engines): faster on GPUs and AMX CPUs, log-probs then corrected (None = with bf16 or on a GPU)")
    gradient_checkpointing: bool = _f(True, "recompute activations in backward to save memory")
    logprob_budget_mib: int | None = _f(None, "MiB of float32 logits the log-prob pass makes at once and keeps for its backward: larger computes fewer logits twice (faster past it), smaller lowers the peak (None: a micro-batch's logits whole where they take at most a quarter of the memory free, else 128; docs/training.md)")
    disable_dropout: bool = _f(False, "turn every dropout of the policy off (LoRA's included), so its log-probs are deterministic")
    keep_freed_memory: bool = _f(False, "on Linux, have the C library keep freed CPU memory for reuse while training: half the page faults, CPU steps about 1.05x as fast; the peak can be higher, which covey plan does not count (process-wide)")
    memory_check: bool = _f(True, "before loading the model, estimate a step's peak memory (covey plan) and refuse a run estimated at over 1.5x the device's memory (false: train anyway)")
    # --- output ------------------------------------------------------------------------------
    output_dir: str | None = _f(None, "run folder (default: runs/<date>-<time>); an existing run is never overwritten "
                                      "unless overwrite_output_dir")
    overwrite_output_dir: bool = _f(False, "allow writing into an output_dir that already holds files")
    logging_steps: int = _f(10, "write metrics every this many optimizer steps, each the mean over those steps (as TRL)")
    logging_first_step: bool = _f(False, "also write the first optimizer step's metrics on their own, whatever logging_steps says (as TRL)")
    log_level: str = _f("passive", "what transformers prints while covey runs (passive: errors only)", choices=("passive", "debug", "info", "warning", "error", "critical"))
    log_completions: bool = _f(False, "record sample completions (completions.jsonl and a console table)")
    log_completions_steps: int = _f(5, "record the completions of every this many steps (and of the first and last)")
    num_completions_to_print: int | None = _f(None, "rows of the console completions table (None: all, as TRL)")
    report_to: list[str] = _f(["none"], "trackers that also get the metrics: tensorboard, wandb, trackio, mlflow, or none")
    project: str | None = _f("huggingface", "Trackio's project the run is logged under (None: TRACKIO_PROJECT, else covey)")
    run_name: str | None = _f(None, "the run's name in trackers (default: the run folder's name)")
    save_strategy: str = _f("steps", "when checkpoints are written: every save_steps optimizer steps, after each pass over the training prompts, or never (as TRL; the final model is always saved)", choices=SAVE_STRATEGIES)
    save_steps: int = _f(500, "save_strategy: steps writes a checkpoint every this many optimizer steps (0 = none)")
    save_total_limit: int | None = _f(None, "keep only the newest this many checkpoints (None = keep all)")
    save_only_model: bool = _f(False, "checkpoints of the model alone, without optimizer, scheduler and random states: smaller, but no run can resume from them (as TRL)")
    push_to_hub: bool = _f(False, "upload the final model, and the checkpoints as hub_strategy says, to the Hugging Face Hub (checked before training starts)")
    hub_model_id: str | None = _f(None, "the Hub repo to push to: 'name' (in your namespace) or 'org/name' (default: output_dir's folder name, as TRL)")
    hub_strategy: str = _f("every_save", "what is pushed when: the final model only, also each checkpoint's model, and the newest checkpoint as last-checkpoint/ or every checkpoint in its own folder (as TRL)", choices=HUB_STRATEGIES)
    hub_token: str | None = _f(None, "Hub token with write access (default: HF_TOKEN or the `hf auth login` one); never written to the run folder")
    hub_private_repo: bool | None = _f(None, "create the repo private (None: the namespace's default); an existing repo keeps its visibility")
    hub_revision: str | None = _f(None, "the branch of the repo to push to (None: main)")
    hub_always_push: bool = _f(False, "push every checkpoint, queued behind the upload in progress (false: a checkpoint saved while the previous push is unfinished is not pushed, as TRL)")
    resume_from_checkpoint: str | None = _f(None, "continue a run: 'auto' (newest checkpoint in output_dir) or a checkpoint folder")

    @property
    def quantization(self) -> str | None:
        """'4bit' or '8bit' (load_in_4bit, load_in_8bit), else None."""
        return "4bit" if self.load_in_4bit else "8bit" if self.load_in_8bit else None

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

    def logprob_budget_bytes(self, vocab: int, free_bytes: int | None) -> int:
        """The log-prob pass's budget for a model of ``vocab`` tokens with ``free_bytes`` of memory free
        (``core.logprob_budget``): the head runs on a micro-batch's completion tokens and its prompts' last
        positions."""
        return core.logprob_budget(self.logprob_budget_mib,
                                   self.per_device_train_batch_size * (self.max_completion_length + 1), vocab,
                                   free_bytes)
