"""Names of TRL's GRPOConfig fields (TRL 1.16, TrainingArguments included).

covey accepts a TRL config as it is for every field it supports; a TRL field it does not support is
rejected by name instead of being silently ignored. This list tells the two kinds of unknown key
apart: a TRL field covey lacks, and a typo. ``AS_COVEY_DOES`` names the TRL settings whose value
describes what covey does anyway: those are accepted (and have nothing more to do).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import os
import typing
from typing import Any
from covey.errors import warn


class _AnyValue:
    """In ``AS_COVEY_DOES``: every value of the setting describes what covey does (it changes nothing covey
    computes), so any is accepted."""

    def __repr__(self) -> str:
        return "any value"


ANY_VALUE = _AnyValue()

# transformers' AcceleratorConfig at its defaults (TRL's GRPOConfig fills accelerator_config with them)
ACCELERATOR_DEFAULTS = {"split_batches": False, "dispatch_batches": None, "even_batches": True,
                        "use_seedable_sampler": True, "non_blocking": False, "gradient_accumulation_kwargs": None,
                        "use_configured_state": False}

# the settings of a tracker, which change nothing while that tracker is not in report_to (as in TRL)
TRACKER_SETTINGS = {"trackio_space_id": "trackio", "trackio_bucket_id": "trackio", "trackio_static_space_id": "trackio"}

AS_COVEY_DOES = {
    "optim": ("adamw_torch_fused", "adamw_torch"),  # covey's optimizer is torch's AdamW
    "logging_strategy": ("steps",),  # metrics every logging_steps
    "remove_unused_columns": (False,),  # every column reaches the reward functions
    "gradient_checkpointing_kwargs": (None, {"use_reentrant": False}),  # transformers' default
    "fp16": (False,), "bf16_full_eval": (False,), "fp16_full_eval": (False,), "tf32": (None, False),
    "torch_compile": (False,), "use_liger_kernel": (False,),
    "disable_tqdm": (None, ANY_VALUE),  # covey draws no progress bar of transformers' (TRL sets it from the log level)
    "ignore_data_skip": (False,), "data_seed": (None,),
    # read by scripts, not by TRL's trainer
    "do_train": (False, True), "do_eval": (False, True), "do_predict": (False, True),
    # TRL's model and script arguments whose value is what covey does
    "eval_on_start": (False, True),  # covey evaluates before training whenever it has held-out data
    "lora_task_type": ("CAUSAL_LM",), "dataset_streaming": (False,), "ignore_bias_buffers": (False,),
    # TrainingArguments at TRL's defaults, as a saved or full recipe lists them: features that are off,
    # or machinery covey does not have (a dataloader, DeepSpeed, accelerate), whose default changes nothing
    "accelerator_config": (None, ACCELERATOR_DEFAULTS), "activation_checkpointing": (None, False), "activation_checkpointing_kwargs": (None,),
    "auto_find_batch_size": (False,), "batch_eval_metrics": (False,), "cache_implementation": (None,),
    "dataloader_drop_last": (False,), "dataloader_in_order": (True,),
    # how a data loader would fetch rows: covey reads its prompts in the trainer's process, whatever these say
    "dataloader_multiprocessing_context": (None, ANY_VALUE), "dataloader_num_workers": (0, ANY_VALUE),
    "dataloader_persistent_workers": (False, ANY_VALUE), "dataloader_pin_memory": (True, ANY_VALUE),
    "dataloader_prefetch_factor": (None, ANY_VALUE), "debug": ("", []), "deepspeed": (None,), "ds3_gather_for_generation": (True,),
    "enable_jit_checkpoint": (False,), "eval_accumulation_steps": (None,), "eval_delay": (0, 0.0),
    "eval_do_concat_batches": (True,), "eval_use_gather_object": (False,),
    "full_determinism": (False,), "greater_is_better": (None,), "include_for_metrics": ([],),
    "include_num_input_tokens_seen": ("no", False), "label_names": (None,), "label_smoothing_factor": (0.0, 0),
    "length_column_name": ("length",), "liger_kernel_config": (None,), "load_best_model_at_end": (False,),
    "local_rank": (-1,), "log_completions_hub_repo": (None,), "log_multimodal": (True, False), "log_on_each_node": (True, False),  # one machine: the first process logs
    "log_unique_prompts": (False,), "metric_for_best_model": (None,), "neftune_noise_alpha": (None,),
    "optim_args": (None,), "optim_target_modules": (None,), "parallelism_config": (None,), "prediction_loss_only": (False,),
    "restore_callback_states_from_checkpoint": (False,), "save_on_each_node": (False,),
    "skip_memory_metrics": (True,), "torch_compile_backend": (None,), "torch_compile_mode": (None,),
    "torch_empty_cache_steps": (None,), "trackio_bucket_id": (None,), "trackio_space_id": (None,),
    "trackio_static_space_id": (None,), "transformers_continuous_batching_config": (None,),
    "use_transformers_continuous_batching": (False,), "use_transformers_paged": (False,),
    "vllm_max_model_length": (None,),  # covey sizes vLLM's context to max_prompt_length + max_completion_length
    "vllm_model_impl": ("vllm",), "vllm_structured_outputs_regex": (None,), "vllm_tensor_parallel_size": (1,),
    "use_cache": (False, True),  # only how generate is computed: covey's engines keep a KV cache, same numbers
    "pad_to_multiple_of": ("auto", ANY_VALUE),  # padding covey packs away (train/forward.py): no effect on a number
    # TRL's AsyncGRPOConfig: its own asynchronous machinery (a request queue, forks, a heartbeat); covey's
    # worker samples whole rounds and pushes the weights after each (docs/async.md)
    "fork_threshold_tokens": (1024,), "request_timeout": (600,), "token_budget": (None,),
    "max_inflight_tasks": (-1,), "queue_maxsize": (1024,), "weight_sync_steps": (1,),
    "heartbeat_stale_after_s": (300.0, 300),
    "average_tokens_across_devices": (True,),  # the loss's token counts are summed over the processes
    "ddp_backend": (None,), "ddp_broadcast_buffers": (None,), "ddp_bucket_cap_mb": (None,),
    "ddp_find_unused_parameters": (None,), "ddp_static_graph": (None,),  # covey sets up DDP itself
    "log_level_replica": ("warning",), "logging_nan_inf_filter": (True,),  # a NaN step is skipped, not averaged
    "train_sampling_strategy": ("random",),  # the prompts are shuffled, every pass anew
}


# covey's defaults that differ from TRL 1.16's, and why (docs/trl.md lists them; a run leaving one at covey's
# default says so once): what covey does, and TRL's default
DEFAULTS_DIFFER = {
    "bf16": ("None: bfloat16 autocast only on a CUDA GPU that computes in it; float32 on a CPU",
             "None: bfloat16 everywhere unless fp16"),
    "vllm_group_port": ("0: a free port", "51216"),
    "output_dir": ("None: a new runs/<date>-<time> folder, never written over", "None: trainer_output"),
}


def defaults_note(config: Any) -> str | None:
    """The line a run prints once: covey's defaults it runs with that differ from TRL's (None: none); the
    weight-transfer port only where a vLLM server is used."""
    server = config.rollout_engine == "vllm" and config.vllm_mode == "server"
    differ = [f"{name} {covey} (TRL: {trl})" for name, (covey, trl) in DEFAULTS_DIFFER.items()
              if name not in config.fields_given and (server or name != "vllm_group_port")]
    return "covey's defaults that differ from TRL's (docs/trl.md): " + "; ".join(differ) if differ else None


# TRL's model and script arguments (trl.ModelConfig, trl.ScriptArguments) that are covey fields under
# another name: a TRL recipe's YAML gives them beside the GRPOConfig fields
SAME_AS = {
    "model_name_or_path": "model",
    "dataset_name": "dataset",
    "dataset_train_split": "dataset_split",
    "torch_dtype": "dtype",  # transformers' older name
    "vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max",  # TRL's older name
}

# older names TRL lists at None when they are unset (the newer name says the value)
UNSET_WHEN_NONE = {"vllm_importance_sampling_cap"}

# TRL fields that GRPOConfig.from_dict turns into covey's own (the computations are there)
READ_AS = {
    "generation_batch_size": "`steps_per_generation` = generation_batch_size / (per_device_train_batch_size * processes)",
    "vllm_server_base_url": "`vllm_server_host` and `vllm_server_port` (http only)",
}

# what other trainers and recipes call some of covey's fields: said first when a key is unknown
NAMES_ELSEWHERE = {
    "lr": "learning_rate", "batch_size": "per_device_train_batch_size", "train_batch_size": "per_device_train_batch_size",
    "max_new_tokens": "max_completion_length", "response_length": "max_completion_length",
    "max_response_length": "max_completion_length", "max_prompt_len": "max_prompt_length",
    "group_size": "num_generations", "n_samples_per_prompt": "num_generations", "rollout_n": "num_generations",
    "kl_coef": "beta", "kl_coeff": "beta", "init_kl_coef": "beta", "kl_loss_coef": "beta",
    "clip_range": "epsilon", "cliprange": "epsilon", "clip_ratio": "epsilon", "clip_ratio_high": "epsilon_high",
    "epochs": "num_train_epochs", "num_epochs": "num_train_epochs", "total_training_steps": "max_steps", "steps": "max_steps",
    "model_name": "model", "model_path": "model", "model_id": "model", "pretrain": "model",
    "dataset_path": "dataset", "train_file": "dataset", "train_files": "dataset", "data_path": "dataset",
    "save_dir": "output_dir", "output_path": "output_dir", "reward_fn": "reward_funcs", "reward_functions": "reward_funcs",
}


def trl_config_values(config: Any) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """The settings of a TRL ``GRPOConfig`` object (or of a subclass of it), as covey reads a config: (TRL's
    fields, the subclass's own fields, the names of those that differ from their defaults). Enumerations become their values; what TRL's ``__post_init__``
    derived from another field (``activation_checkpointing`` from ``gradient_checkpointing``) is left to
    that field; an empty ``report_to`` is TRL's "none"."""
    values = {}
    for f in dataclasses.fields(config):
        if f.init:
            value = getattr(config, f.name)
            values[f.name] = value.value if isinstance(value, enum.Enum) else value
    if values.get("activation_checkpointing") == values.get("gradient_checkpointing"):
        values.pop("activation_checkpointing", None)
    if values.get("report_to") in ([], None):
        values["report_to"] = "none"
    if dataclasses.is_dataclass(values.get("accelerator_config")):
        values["accelerator_config"] = dataclasses.asdict(values["accelerator_config"])
    own = {name: values.pop(name) for name in list(values) if name not in TRL_FIELDS}
    defaults = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                for f in dataclasses.fields(config) if f.init}
    changed = {name for name, value in values.items() if value != defaults.get(name, value)}
    return values, own, changed


def as_covey_does(name: str, value: Any, report_to: Any = "none") -> bool:
    """Whether TRL's setting ``name: value`` describes what covey does anyway (with the trackers of
    ``report_to``: a tracker's settings change nothing while it is off)."""
    allowed = AS_COVEY_DOES.get(name)
    if allowed is None:
        return False
    if name in TRACKER_SETTINGS and TRACKER_SETTINGS[name] not in (report_to if isinstance(report_to, list) else [report_to]):
        return True
    if isinstance(value, str):  # a boolean written as text
        value = {"true": True, "false": False, "none": None, "null": None}.get(value.lower(), value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # transformers' AcceleratorConfig object
        value = dataclasses.asdict(value)
    return ANY_VALUE in allowed or any(value == a and type(value) is type(a) for a in allowed)


TRL_FIELDS = frozenset({
    'accelerator_config', 'activation_checkpointing', 'activation_checkpointing_kwargs', 'adam_beta1',
    'adam_beta2', 'adam_epsilon', 'auto_find_batch_size', 'average_tokens_across_devices',
    'batch_eval_metrics', 'beta', 'bf16', 'bf16_full_eval', 'cache_implementation', 'cast_lm_head_to_fp32',
    'chat_template_kwargs', 'data_seed', 'dataloader_drop_last', 'dataloader_in_order',
    'dataloader_multiprocessing_context', 'dataloader_num_workers', 'dataloader_persistent_workers',
    'dataloader_pin_memory', 'dataloader_prefetch_factor', 'ddp_backend', 'ddp_broadcast_buffers',
    'ddp_bucket_cap_mb', 'ddp_find_unused_parameters', 'ddp_static_graph', 'ddp_timeout', 'debug',
    'deepspeed', 'delta', 'disable_dropout', 'disable_tqdm', 'do_eval', 'do_predict', 'do_train',
    'ds3_gather_for_generation', 'enable_jit_checkpoint', 'entropy_coef', 'entropy_coef_delta',
    'entropy_coef_max', 'entropy_coef_min', 'entropy_target', 'epsilon', 'epsilon_high',
    'eval_accumulation_steps', 'eval_delay', 'eval_do_concat_batches', 'eval_on_start', 'eval_steps',
    'eval_strategy', 'eval_use_gather_object', 'fp16', 'fp16_full_eval', 'fsdp', 'fsdp_config',
    'full_determinism', 'generation_batch_size', 'generation_kwargs', 'gradient_accumulation_steps',
    'gradient_checkpointing', 'gradient_checkpointing_kwargs', 'greater_is_better', 'hub_always_push',
    'hub_model_id', 'hub_private_repo', 'hub_revision', 'hub_strategy', 'hub_token', 'ignore_data_skip',
    'importance_sampling_level', 'include_for_metrics', 'include_num_input_tokens_seen', 'label_names',
    'label_smoothing_factor', 'learning_rate', 'length_column_name', 'liger_kernel_config',
    'load_best_model_at_end', 'local_rank', 'log_completions', 'log_completions_hub_repo', 'log_level',
    'log_level_replica', 'log_multimodal', 'log_on_each_node', 'log_unique_prompts', 'logging_first_step',
    'logging_nan_inf_filter', 'logging_steps', 'logging_strategy', 'loss_type', 'lr_scheduler_kwargs',
    'lr_scheduler_type', 'mask_truncated_completions', 'max_completion_length', 'max_grad_norm', 'max_steps',
    'max_tool_calling_iterations', 'metric_for_best_model', 'min_p', 'model_init_kwargs',
    'multi_objective_aggregation', 'neftune_noise_alpha', 'num_completions_to_print', 'num_generations',
    'num_generations_eval', 'num_iterations', 'num_train_epochs', 'off_policy_mask_threshold', 'optim',
    'optim_args', 'optim_target_modules', 'output_dir', 'pad_to_multiple_of', 'parallelism_config',
    'per_device_eval_batch_size', 'per_device_train_batch_size', 'prediction_loss_only', 'project',
    'push_to_hub', 'ref_model_mixup_alpha', 'ref_model_sync_steps', 'remove_unused_columns',
    'repetition_penalty', 'report_to', 'restore_callback_states_from_checkpoint', 'resume_from_checkpoint',
    'reward_weights', 'router_aux_loss_coef', 'run_name', 'sapo_temperature_neg', 'sapo_temperature_pos',
    'save_on_each_node', 'save_only_model', 'save_steps', 'save_strategy', 'save_total_limit',
    'scale_rewards', 'seed', 'shuffle_dataset', 'skip_memory_metrics', 'steps_per_generation',
    'sync_ref_model', 'temperature', 'tf32', 'top_entropy_quantile', 'top_k', 'top_p', 'torch_compile',
    'torch_compile_backend', 'torch_compile_mode', 'torch_empty_cache_steps', 'trackio_bucket_id',
    'trackio_space_id', 'trackio_static_space_id', 'train_sampling_strategy',
    'transformers_continuous_batching_config', 'trust_remote_code', 'use_adaptive_entropy',
    'use_bias_correction_kl', 'use_cache', 'use_cpu', 'use_liger_kernel',
    'use_transformers_continuous_batching', 'use_transformers_paged', 'use_vllm', 'vespo_k_neg',
    'vespo_k_pos', 'vespo_lambda_neg', 'vespo_lambda_pos', 'vllm_enable_sleep_mode',
    'vllm_gpu_memory_utilization', 'vllm_group_port', 'vllm_importance_sampling_cap',
    'vllm_importance_sampling_clip_max', 'vllm_importance_sampling_clip_min',
    'vllm_importance_sampling_correction', 'vllm_importance_sampling_mode', 'vllm_max_model_length',
    'vllm_mode', 'vllm_model_impl', 'vllm_server_base_url', 'vllm_server_host', 'vllm_server_port',
    'vllm_server_timeout', 'vllm_structured_outputs_regex', 'vllm_tensor_parallel_size', 'warmup_steps',
    'weight_decay'
})


# ---- TRL's names and rules as covey's fields -------------------------------------------------------


def covey_names(values: dict[str, Any], defaults: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """TRL's names and rules turned into covey's fields: (covey's fields, the TRL settings accepted as what
    covey does anyway, the problems). Both doors (Python's ``GRPOConfig(...)``, and YAML and the command
    line through ``from_dict``) pass here, so a setting is accepted or refused alike in each."""
    known = set(defaults)
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
        values, problem = _generation_batch_as_steps(values, defaults["per_device_train_batch_size"])
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
                "dataset", defaults["dataset"])}
    if values.get("generation_kwargs"):  # sampler settings that are covey's fields move there
        values, problem = _lift_generation_kwargs(values)
        problems.extend(problem)
    if values.get("num_train_epochs") is not None and "max_steps" not in values:
        values = {**values, "max_steps": -1}  # TRL's rule: the epochs set the length unless max_steps is given
    elif values.get("num_train_epochs") not in (None, 3.0) and str(values["max_steps"]).strip() != "-1":  # 3: the default
        warn(f"num_train_epochs={values['num_train_epochs']} has no effect: max_steps="
                      f"{values['max_steps']} sets the run's length (as in TRL)", stacklevel=3)
        values = {**values, "num_train_epochs": None}
    accepted = {}
    for key in values:
        if not isinstance(key, str):
            problems.append(f"config key {key!r} is not a name; keys are field names such as learning_rate")
        elif key in known:
            continue
        elif as_covey_does(key, values[key], values.get("report_to", "none")):
            accepted[key] = values[key]
        elif key in AS_COVEY_DOES:
            tracker = f" while report_to includes {TRACKER_SETTINGS[key]}" if key in TRACKER_SETTINGS else ""
            problems.append(f"{key}: {values[key]!r} is a TRL setting covey does not support{tracker} (covey works as "
                            f"{key}: {' or '.join(map(repr, AS_COVEY_DOES[key]))}); remove it")
        else:
            problems.append(f"unknown config key {key!r}{suggest_field(key, known)}")
    return {key: value for key, value in values.items() if key in known}, accepted, problems


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


def _generation_batch_as_steps(values: dict[str, Any], per_device_default: int) -> tuple[dict[str, Any], list[str]]:
    """TRL's generation_batch_size (completions per generation over all the launched processes) as covey's
    steps_per_generation."""
    size = values["generation_batch_size"]
    values = {k: v for k, v in values.items() if k != "generation_batch_size"}
    if size is None or str(size).lower() in ("none", "null"):
        return values, []
    processes = int(os.environ.get("WORLD_SIZE", "1") or 1)  # as the launcher started them, as TRL counts
    try:
        size, per_device = int(size), int(values.get("per_device_train_batch_size", per_device_default))
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


def _did_you_mean(name: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""



# names other tools use for a field, suggested before any spelling match
def suggest_field(name: str, fields: typing.Iterable[str]) -> str:
    """What to say after an unknown key ``name``: covey's field for what other trainers call so, else the
    closest field name (or nothing)."""
    if name in NAMES_ELSEWHERE:
        return f" (covey's name for it: {NAMES_ELSEWHERE[name]})"
    return _did_you_mean(name, fields)
