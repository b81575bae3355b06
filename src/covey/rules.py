"""Every setting covey refuses is a rule in a table, and each table is one phase of checking:

    CONFIG_RULES   from the config alone, when it is read (``GRPOConfig(...)``, YAML, the command line):
                   here
    RUN_RULES      from what the trainer was handed and how it was launched (model, engine, processes,
                   data, rewards), before any policy weights load: ``covey.train.run_rules``
    ENGINE_RULES   from the rollout engine once it is built: ``covey.train.run_rules``

Each rule is a function of its phase's facts that reports each problem through ``need(ok, message)``;
every problem of a phase is said at once, in one ``ConfigError`` (``check``). A rule may return a note
(a string: something allowed but worth saying, such as a check it could not make), which ``check`` shows
as a warning once the phase passes; a rule itself writes nothing. A rule is written once, whichever door
the setting came through. ``advise`` warns about settings that are allowed but rarely
meant.

Who owns what: ``covey.config.GRPOConfig`` runs ``CONFIG_RULES`` on itself when it is made, so it imports
this module; the rules read a config's fields, which are ``covey.config_fields.RunSettings`` (the class
``GRPOConfig`` is made of). This module imports those fields and covey's errors, nothing else of covey's.
"""

from __future__ import annotations

from typing import Any, Callable

from covey.config_fields import RunSettings
from covey.errors import ConfigError, config_errors, warn

Need = Callable[[bool, str], None]

# generation_kwargs keys (transformers', vLLM's names) that covey's own fields set
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_tokens": "max_completion_length",
                   "max_new_tokens": "max_completion_length", "stop": "stop_strings", "stop_strings": "stop_strings",
                   "n": "num_generations", "num_return_sequences": "num_generations", "seed": "seed",
                   "do_sample": "temperature (covey always samples in training)", "logprobs": "sampler's output"}
VESPO_SEQUENCE_CORRECTION = (
    "loss_type: vespo folds the engine/trainer importance weights into its sequence weight token by token (as TRL "
    "does), and vllm_importance_sampling_mode gives one weight per sequence; set vllm_importance_sampling_mode: "
    "token_truncate or token_mask, or vllm_importance_sampling_correction: false")
VLLM_SEED = "seed={seed}: vLLM takes seeds from 0 to 2**32 - 1 (numpy's range); give one there"
TRACKERS = ("mlflow", "none", "tensorboard", "trackio", "wandb")


def _collect(rules: tuple, *facts: Any, problems: list[str] | None = None,
             notes: list[str] | None = None) -> list[str]:
    """Every problem the ``rules`` find in ``facts``; a rule that raises ConfigError itself adds its own.
    The notes the rules return are added to ``notes``."""
    problems = [] if problems is None else problems
    notes = [] if notes is None else notes

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    for rule in rules:
        try:
            if (note := rule(*facts, need)) is not None:
                notes.append(note)
        except ConfigError as e:
            problems.extend(getattr(e, "problems", None) or [str(e)])
        except (ArithmeticError, TypeError, ValueError):  # a rule that needs a value an earlier one refused
            if not problems:
                raise
    return problems


def check(rules: tuple, *facts: Any, source: str | None = None) -> None:
    """Apply one phase's ``rules`` to its ``facts``: every problem at once, in one ConfigError; where there is
    none, the notes the rules returned, each as a warning."""
    notes: list[str] = []
    if problems := _collect(rules, *facts, notes=notes):
        raise config_errors(problems, source)
    for note in notes:
        warn(note, stacklevel=2)


# ---- phase 1: the config alone ----------------------------------------------------------------------

def batch_shape(c: RunSettings, need: Need) -> None:
    """Groups, micro-batches and the run's length."""
    need(c.num_generations >= 2, f"num_generations={c.num_generations}: a group needs at least 2 completions")
    spg = c.micro_batches_per_generation
    need(
        c.num_generations < 1 or c.generation_batch_size % c.num_generations == 0,
        f"per_device_train_batch_size * {'steps_per_generation' if c.steps_per_generation else 'gradient_accumulation_steps'}"
        f" = {c.per_device_train_batch_size} * {spg} = {c.generation_batch_size} completions per generation is "
        f"not divisible by num_generations={c.num_generations}; make it a multiple so every prompt gets a whole group",
    )
    need(c.gradient_accumulation_steps < 1 or spg % c.gradient_accumulation_steps == 0,
         f"steps_per_generation={spg} must be a multiple of gradient_accumulation_steps={c.gradient_accumulation_steps}")
    need(c.max_steps >= 1 or c.max_steps == -1,
         f"max_steps={c.max_steps} must be at least 1, or -1 to train for num_train_epochs")
    epochs = "None" if c.num_train_epochs is None else f"{c.num_train_epochs:g}"
    need(c.num_train_epochs is None or c.num_train_epochs > 0,
         f"num_train_epochs={epochs} must be positive")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                 "max_completion_length", "max_prompt_length", "logging_steps", "ref_model_sync_steps",
                 "dynamic_sampling_max_rounds", "max_consecutive_bad_steps"):
        need(getattr(c, name) >= 1, f"{name}={getattr(c, name)} must be at least 1")
    need(c.steps_per_generation is None or c.steps_per_generation >= 1,
         f"steps_per_generation={c.steps_per_generation} must be at least 1")
    need(abs(c.seed) < 2**62, f"seed={c.seed} is too large: give a seed below 2**62")


def clipping_and_loss(c: RunSettings, need: Need) -> None:
    """The clip, the KL and the objectives that replace the clipped surrogate, and the entropy bonus:
    each in range, none given where nothing would read it."""
    if c.delta is not None:
        need(c.delta > 1 + (c.epsilon if c.epsilon_high is None else c.epsilon_high),
             f"delta={c.delta} must exceed 1 + epsilon_high, or it clips every ratio")
    if c.clip_ratio_c is not None:
        need(c.clip_ratio_c > 1, f"clip_ratio_c={c.clip_ratio_c} must be > 1 (dual-clip uses about 3)")
    need(0 < c.top_entropy_quantile <= 1, f"top_entropy_quantile={c.top_entropy_quantile} must be in (0, 1]")
    need(c.beta >= 0, f"beta={c.beta} must be >= 0")
    need(c.epsilon >= 0 and (c.epsilon_high is None or c.epsilon_high >= 0), "epsilon and epsilon_high must be >= 0")
    own_weight = {"cispo": "it caps its own weight at epsilon_high",
                  "sapo": "its soft gate, shaped by sapo_temperature_pos/neg, replaces the clip",
                  "vespo": "its sequence weight, shaped by vespo_k_*/vespo_lambda_*, replaces the clip"}
    if c.loss_type in own_weight:
        for name in ("delta", "clip_ratio_c") + (("epsilon_high",) if c.loss_type != "cispo" else ()):
            need(getattr(c, name) is None,
                 f"{name} clips the PPO ratio, which loss_type: {c.loss_type} does not use "
                 f"({own_weight[c.loss_type]}); unset {name} or choose another loss_type")
    need(c.sapo_temperature_pos > 0 and c.sapo_temperature_neg > 0,
         f"sapo_temperature_pos={c.sapo_temperature_pos} and sapo_temperature_neg={c.sapo_temperature_neg} "
         "must be positive")
    need(min(c.vespo_k_pos, c.vespo_k_neg, c.vespo_lambda_pos, c.vespo_lambda_neg) >= 0,
         f"vespo_k_pos={c.vespo_k_pos}, vespo_k_neg={c.vespo_k_neg}, vespo_lambda_pos={c.vespo_lambda_pos} "
         f"and vespo_lambda_neg={c.vespo_lambda_neg} must be >= 0")
    need(c.loss_type != "vespo" or c.importance_sampling_level == "token",
         "loss_type: vespo weighs each sequence by its own importance weight, computed from the token ratios: "
         "importance_sampling_level: sequence has no meaning for it; set importance_sampling_level: token")
    if c.loss_type == "vespo" and c.rollout_engine == "vllm" and c.vllm_importance_sampling_correction:
        need(c.vllm_importance_sampling_mode.startswith("token"), VESPO_SEQUENCE_CORRECTION)
    need(c.off_policy_mask_threshold is None or c.off_policy_mask_threshold > 0,
         f"off_policy_mask_threshold={c.off_policy_mask_threshold} must be positive (None: no off-policy mask)")
    need(c.entropy_coef >= 0, f"entropy_coef={c.entropy_coef} must be >= 0 (an entropy bonus; 0 = off)")
    need(0 <= c.entropy_coef_min <= c.entropy_coef_max,
         f"entropy_coef_min={c.entropy_coef_min} and entropy_coef_max={c.entropy_coef_max} must satisfy "
         "0 <= entropy_coef_min <= entropy_coef_max")
    need(c.entropy_coef_delta > 0 and c.entropy_target >= 0,
         f"entropy_coef_delta={c.entropy_coef_delta} must be positive and entropy_target={c.entropy_target} "
         ">= 0")
    # a setting of a variant the run does not use would be ignored: refused instead
    unused = [(("sapo_temperature_pos", "sapo_temperature_neg"), c.loss_type == "sapo", "loss_type: sapo"),
              (("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), c.loss_type == "vespo",
               "loss_type: vespo"),
              (("entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max"),
               c.use_adaptive_entropy, "use_adaptive_entropy: true")]
    for names, used, needs in unused:
        for name in names:
            value = getattr(c, name)
            need(used or value == type(c).__dataclass_fields__[name].default,
                 f"{name}={value} has an effect only with {needs}; set that, or remove {name}")


def reference_model(c: RunSettings, need: Need) -> None:
    """The reference model and its syncing."""
    need(0 <= c.ref_model_mixup_alpha <= 1, f"ref_model_mixup_alpha={c.ref_model_mixup_alpha} must be in [0, 1]")
    need(not c.sync_ref_model or c.beta > 0,
         "sync_ref_model needs beta > 0: with beta 0 there is no reference model to sync")


def asynchronous_generation(c: RunSettings, need: Need) -> None:
    """Generation ahead of training (docs/async.md)."""
    if c.async_generation:
        steps = c.optimizer_steps_per_generation
        need(c.max_staleness >= steps, f"async_generation: max_staleness={c.max_staleness} is below the "
             f"{steps} optimizer step(s) of each generation round, so no round could be sampled ahead; set "
             f"max_staleness to {steps} (one round ahead) or more")
        need(c.vllm_importance_sampling_correction, "async_generation samples with an older policy, and "
             "vllm_importance_sampling_correction: false turns off the correction for it; leave it on")
        need(not c.vllm_enable_sleep_mode, "async_generation: vllm_enable_sleep_mode puts vLLM to sleep "
             "between generations, and under async_generation it samples while the trainer trains; set "
             "vllm_enable_sleep_mode: false")


def vllm_seed(c: RunSettings, need: Need) -> None:
    """vLLM seeds numpy with the seed, which takes 0 to 2**32 - 1 only (a colocated engine, a vLLM server)."""
    need(0 <= c.seed < 2**32, VLLM_SEED.format(seed=c.seed))


def sampling(c: RunSettings, need: Need) -> None:
    """How the training rounds sample."""
    need(c.temperature > 0, f"temperature={c.temperature} must be positive (use a small value for near-greedy)")
    need(0 < c.top_p <= 1, f"top_p={c.top_p} must be in (0, 1]")
    need(c.top_k >= 0, f"top_k={c.top_k} must be >= 0 (0 = off)")
    need(c.min_p is None or 0 <= c.min_p < 1, f"min_p={c.min_p} must be in [0, 1)")
    need(c.repetition_penalty > 0, f"repetition_penalty={c.repetition_penalty} must be positive")
    need(not (c.stop_strings and c.rollout_engine == "hf"),
         "stop_strings need rollout_engine: fast (transformers generate cannot report where they ended)")
    for key in sorted(set(c.generation_kwargs or {})):
        need(key not in SAMPLING_FIELDS, f"generation_kwargs: {key} is covey's {SAMPLING_FIELDS.get(key)}, "
                                         "which the log-probs are computed with too; set that field instead")
    need(not c.generation_kwargs or c.rollout_engine != "fast",
         f"generation_kwargs {sorted(c.generation_kwargs or {})} are settings of transformers' generate or "
         "vLLM, and rollout_engine: fast samples with covey's fields only; use rollout_engine: hf or vllm (the "
         "default with generation_kwargs), or remove them")


def engines(c: RunSettings, need: Need) -> None:
    """The rollout engines' own settings."""
    need(c.vllm_importance_sampling_clip_max > 0, "vllm_importance_sampling_clip_max must be positive")
    if c.rollout_engine == "vllm":
        vllm_seed(c, need)
    need(not c.vllm_enable_sleep_mode or (c.rollout_engine == "vllm" and c.vllm_mode == "colocate"),
         "vllm_enable_sleep_mode puts the vLLM of vllm_mode: colocate to sleep while the trainer trains; this run "
         f"samples with rollout_engine: {c.rollout_engine}, vllm_mode: {c.vllm_mode} (a vLLM server sleeps "
         "by its own flags): set vllm_enable_sleep_mode: false")
    need(1 <= c.vllm_server_port <= 65535, f"vllm_server_port={c.vllm_server_port} must be in 1..65535")
    need(c.vllm_server_timeout > 0, f"vllm_server_timeout={c.vllm_server_timeout} must be positive")
    need(0 <= c.vllm_group_port <= 65535, f"vllm_group_port={c.vllm_group_port} must be in 0..65535 (0: a free one)")
    need(c.vllm_importance_sampling_clip_min is None or c.vllm_importance_sampling_clip_min >= 0,
         f"vllm_importance_sampling_clip_min={c.vllm_importance_sampling_clip_min} must be >= 0")
    need(0 < c.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization must be in (0, 1]")


def optimizer(c: RunSettings, need: Need) -> None:
    """AdamW, the gradient clip, the log-prob pass's budget and the learning-rate schedule."""
    need(c.learning_rate > 0, f"learning_rate={c.learning_rate} must be positive")
    need(0 <= c.warmup_ratio < 1, f"warmup_ratio={c.warmup_ratio} must be in [0, 1)")
    need(0 <= c.warmup_steps and (c.warmup_steps < 1 or c.warmup_steps == int(c.warmup_steps)),
         f"warmup_steps={c.warmup_steps:g} must be a whole number of steps, or a fraction of max_steps in [0, 1)")
    need(not (c.warmup_steps and c.warmup_ratio),
         f"warmup_steps={c.warmup_steps:g} and warmup_ratio={c.warmup_ratio} both set the warmup; keep one")
    need(c.max_grad_norm >= 0, f"max_grad_norm={c.max_grad_norm} must be >= 0")
    need(c.logprob_budget_mib is None or c.logprob_budget_mib >= 1, f"logprob_budget_mib={c.logprob_budget_mib} must be at least 1 (MiB of the "
         "log-prob pass's float32 logits)")
    need(0 <= c.adam_beta1 < 1 and 0 <= c.adam_beta2 < 1 and c.adam_epsilon > 0 and c.weight_decay >= 0,
         f"AdamW settings out of range: adam_beta1={c.adam_beta1}, adam_beta2={c.adam_beta2} (each in [0, 1)), "
         f"adam_epsilon={c.adam_epsilon} (> 0), weight_decay={c.weight_decay} (>= 0)")
    kwargs = c.lr_scheduler_kwargs or {}
    if c.lr_scheduler_type == "cosine_with_min_lr":
        need(len(kwargs) == 1 and set(kwargs) <= {"min_lr_rate", "min_lr"},
             f"lr_scheduler_type: cosine_with_min_lr needs lr_scheduler_kwargs with one of min_lr_rate (a fraction "
             f"of learning_rate) or min_lr, as in transformers; got {kwargs}")
        need(all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in kwargs.values()),
             f"lr_scheduler_kwargs {kwargs}: the floor must be a number >= 0")
    else:
        need(not kwargs, f"lr_scheduler_kwargs {kwargs} has no meaning for lr_scheduler_type: "
                         f"{c.lr_scheduler_type}; remove it")


def model_loading(c: RunSettings, need: Need) -> None:
    """LoRA, quantization and what model_init_kwargs may hold."""
    need(c.lora_r >= 1 and c.lora_alpha > 0 and 0 <= c.lora_dropout < 1,
         f"LoRA settings out of range: lora_r={c.lora_r} (>= 1), lora_alpha={c.lora_alpha} (> 0), "
         f"lora_dropout={c.lora_dropout} (in [0, 1))")
    need(not c.use_peft or c.lora_target_modules != [],
         "lora_target_modules is empty: name the modules LoRA wraps (q_proj, v_proj, ...) or use all-linear")
    need(not (c.load_in_4bit and c.load_in_8bit), "load_in_4bit and load_in_8bit both set: choose one")
    for key, instead in (("quantization_config", "load_in_4bit or load_in_8bit"),
                         ("device_map", "use_cpu (covey places the model on its device)")):
        need(key not in (c.model_init_kwargs or {}), f"model_init_kwargs: {key} is set by covey's {instead}; "
                                                        "remove it from model_init_kwargs")


def rewards_and_tools(c: RunSettings, need: Need) -> None:
    """Reward functions, their time limits and workers, and tools."""
    need(c.reward_timeout is None or c.reward_timeout > 0, f"reward_timeout={c.reward_timeout} must be positive")
    need((c.overlong_max_length is None or c.overlong_max_length >= 1)
         and (c.overlong_cache_length is None or c.overlong_cache_length >= 1),
         "overlong_max_length and overlong_cache_length must be at least 1")
    need(c.reward_num_workers >= 0, f"reward_num_workers={c.reward_num_workers} must be >= 0")
    need(c.max_tool_calling_iterations is None or c.max_tool_calling_iterations >= 1,
         f"max_tool_calling_iterations={c.max_tool_calling_iterations} must be at least 1 (None: no limit)")
    need(c.tool_timeout > 0, f"tool_timeout={c.tool_timeout} must be positive")
    need(c.code_timeout > 0 and c.code_memory_limit_mb >= 16,
         "code_timeout must be positive and code_memory_limit_mb at least 16")
    need(len(c.reward_funcs) >= 1, "reward_funcs is empty: name at least one reward function")


def evaluation_and_outputs(c: RunSettings, need: Need) -> None:
    """Held-out evaluation, checkpoints, logs, trackers and the process group."""
    need(c.eval_max_samples >= 0, f"eval_max_samples={c.eval_max_samples} must be >= 0")
    need(c.per_device_eval_batch_size >= 1 and (c.num_generations_eval or 1) >= 1,
         "per_device_eval_batch_size and num_generations_eval must be at least 1")
    need(c.eval_steps is None or c.eval_steps >= 1, f"eval_steps={c.eval_steps} must be at least 1")
    need(c.eval_strategy == "no" or c.eval_max_samples != 0,
         "eval_strategy: steps evaluates on held-out rows, and eval_max_samples: 0 takes none; give eval_max_samples "
         "> 0 or set eval_strategy: no")
    need(c.save_steps >= 0, f"save_steps={c.save_steps} must be >= 0 (0 = no checkpoints)")
    need(c.save_total_limit is None or c.save_total_limit >= 1,
         f"save_total_limit={c.save_total_limit} must be at least 1 (None keeps all)")
    need(c.log_completions_steps >= 1 and (c.num_completions_to_print or 0) >= 0,
         "log_completions_steps must be at least 1 and num_completions_to_print >= 0")
    unknown = [t for t in c.report_to if t not in TRACKERS]
    need(not unknown, f"report_to: {', '.join(map(repr, unknown))} is not a tracker; choose from "
                      f"{', '.join(TRACKERS)}")
    need(c.ddp_timeout >= 1, f"ddp_timeout={c.ddp_timeout} must be at least 1 second")


def advise(c: RunSettings) -> None:
    """Settings that are allowed but rarely meant: a warning each."""
    if c.importance_sampling_level == "sequence" and c.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        warn(f"importance_sampling_level: sequence with loss_type: {c.loss_type}, a sum over tokens, "
                      "weights each sequence by its completion length; GSPO's per-sequence objective is "
                      "loss_type: grpo (LUSPO's length weighting on purpose: luspo)", stacklevel=3)
    if c.loss_type == "luspo" and c.importance_sampling_level != "sequence":
        warn("loss_type: luspo weights each sequence's loss by its length, which the paper does with "
                      "the sequence-level ratio; set importance_sampling_level: sequence", stacklevel=3)
    cap = c.epsilon if c.epsilon_high is None else c.epsilon_high
    if c.loss_type == "cispo" and cap <= 1:
        warn(f"loss_type: cispo caps each token's weight at epsilon_high={cap} itself (as TRL does), so "
                      "every weight is below the ratio 1 it starts at; the MiniMax-M1 cap is 1 + eps (TRL's docs "
                      "suggest epsilon_high: 5.0)", stacklevel=3)


CONFIG_RULES = (batch_shape, clipping_and_loss, reference_model, asynchronous_generation, sampling, engines,
                optimizer, model_loading, rewards_and_tools, evaluation_and_outputs)
