"""What a run is built from its config: the reward functions, the training and held-out rows, the
prompts' token ids, the policy, its optimizer and learning-rate schedule, the rollout engine and the
settings of each stage. Each is a function of the config (and what the user handed over), so the
trainer, ``covey eval``, ``covey server`` and ``covey verify`` build the same things the same way."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from covey import core, rules
from covey.agents import FORMATS, Agent, ToolCallFormat, load_tool
from covey.agents.environments import Environments
from covey.config import GRPOConfig
from covey.data import EMPTY_PROMPT, extra_columns, first_rows, heldout_rows, is_stream, load_rows, shared_prompts
from covey.data.text import encode_prompts
from covey.errors import ConfigError, DataError, warn
from covey.models import (ModelLoading, Reference, adapted_shared_matrix, add_lora, check_quantization, default_device,
                          disable_dropout, eos_token_ids, head_in_float32, is_peft_model, load_policy, load_tokenizer,
                          merged_model, plain_model, quiet_transformers, resolve_model_path)
from covey.rewards import (RewardFunc, RewardModel, check_reward_columns, load_reward_func, preflight_check,
                           reward_name)
from covey.rollout import EngineSettings, RolloutEngine, SamplingParams, make_engine
from covey.rollout.engine import missing_members
from covey.rollout.server import FastBackend, VLLMServe, vllm_serve_command
from covey.rollout.vllm_engine import check_vllm
from covey.rollout.weight_transfer import BACKEND
from covey.rollout.wire import server_token
from covey.sources import load_reference
from covey.train.distributed import World
from covey.train.forward import TrainingForward
from covey.train.sharding import PolicyCopy, Sharding, shard
from covey.vision.models import freeze_vision_parts, is_vision_model, vision_lora_options

# ---- rewards and data -----------------------------------------------------------------------------


def builtin_reward_settings(args: GRPOConfig) -> dict[str, dict]:
    """Keyword arguments of the built-in rewards that take settings, from the config."""
    overlong_max = args.overlong_max_length or args.max_completion_length
    return {"soft_overlong_penalty": {"max_length": overlong_max,
                                      "cache_length": args.overlong_cache_length or max(1, overlong_max // 4)},
            "code_tests": {"timeout": args.code_timeout, "memory_limit_mb": args.code_memory_limit_mb}}


def check_data_and_rewards_given(args: GRPOConfig, train_dataset: Any, reward_funcs: Any,
                                 environment_factory: Any) -> None:
    """In Python, as in TRL, the trainer needs its data and its rewards (an environment may bring either):
    covey's defaults (the arithmetic task and its rewards) are the command line's demo, and fill in only
    what a config file, the command line or GRPOConfig(dataset=..., reward_funcs=...) named."""
    environment = environment_factory is not None or bool(args.environment_factory)
    if train_dataset is None and "dataset" not in args.fields_given:
        if not environment:
            raise ConfigError("`train_dataset` is required unless an `environment_factory` is provided (as in TRL); "
                              "give train_dataset=... (rows, a datasets.Dataset, a file or a dataset id), or name one "
                              "in GRPOConfig(dataset=...)")
        if isinstance(environment_factory, dict):
            raise ConfigError("A `dict` environment_factory (several environments) requires a `train_dataset` with an "
                              "`environment` column to choose each row's environment; give one, or a single "
                              "environment factory")
        if args.max_steps < 1 or "max_steps" not in args.fields_given:
            raise ConfigError("without a train_dataset the environment owns the data (reset() returns each prompt), "
                              "so there are no epochs to count: set max_steps to the number of optimizer steps")
    if not reward_funcs and "reward_funcs" not in args.fields_given and not environment:
        raise ConfigError("No reward source provided: give reward_funcs=[...] (functions, built-in names such as "
                          "'accuracy_reward', or a reward model's id), or an environment_factory whose environments "
                          "score episodes (get_reward)")


def load_rewards(args: GRPOConfig, reward_funcs: Sequence[RewardFunc | str] | None = None,
                 reward_processing_classes: Any = None) -> tuple[list[RewardFunc], list[float]]:
    """The reward functions (given, else ``args.reward_funcs``) and their weights (default: all 1.0).
    ``reward_processing_classes`` (TRL's): one tokenizer per function, None for those that are not reward
    models (a single tokenizer for a single function). Reward models given by name load onto the
    policy's device; one given as an object stays where it is (as the policy does), unless use_cpu."""
    if reward_funcs is not None:
        specs = list(reward_funcs)
    else:  # the config's, where it names them (covey's default rewards are the command line's demo)
        specs = list(args.reward_funcs) if "reward_funcs" in args.fields_given else []
    tokenizers = reward_tokenizers(reward_processing_classes, len(specs))
    device = default_device(args.use_cpu)
    quiet_transformers()  # a reward model loads as the policy does: without the library's loading bars
    funcs = [load_reward_func(f, builtin_reward_settings(args), tokenizer, args.trust_remote_code, device)
             for f, tokenizer in zip(specs, tokenizers)]
    if args.use_cpu:
        funcs = [f.to("cpu") if isinstance(f, RewardModel) else f for f in funcs]
    for judge in (f for f in funcs if isinstance(f, RewardModel)):  # it renders chats with the run's variables
        judge.chat_template_kwargs = args.chat_template_kwargs
    names = [reward_name(f) for f in funcs]
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise ConfigError(f"two reward functions are both named {repeated[0]!r}: their metrics and recorded rewards "
                          "would overwrite each other; give each its own name (a def of its own, or set __name__)")
    weights = args.reward_weights or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions; "
                          "give one weight per function")
    return funcs, weights


def reward_tokenizers(reward_processing_classes: Any, count: int) -> list:
    """TRL's ``reward_processing_classes`` as one entry per reward function."""
    if reward_processing_classes is None:
        return [None] * count
    if not isinstance(reward_processing_classes, (list, tuple)):
        reward_processing_classes = [reward_processing_classes]
    if len(reward_processing_classes) != count:
        raise ConfigError(f"the number of reward_processing_classes ({len(reward_processing_classes)}) must match the "
                          f"number of reward functions ({count}); give one per reward function, in the same order "
                          "(None for those that are not reward models)")
    return list(reward_processing_classes)


@dataclasses.dataclass(frozen=True)
class Rows:
    """The rows a run trains and evaluates on, checked against what its reward functions need."""

    source: str  # the dataset's name as the user gave it, or "an in-memory dataset"
    train: list[dict]  # a streamed dataset's first rows, which the checks read
    heldout: list[dict] | None  # None: no before/after evaluation
    stream: Any = None  # a dataset read as a stream (covey.data.stream), to train on from its first row


# rows of a streamed dataset read before training, for the checks of its columns and rewards
STREAM_CHECK_ROWS = 8


def load_run_rows(args: GRPOConfig, train_dataset: Any, eval_dataset: Any, reward_funcs: list[RewardFunc],
                  processes: int, environment: Environments | None = None, own_rollouts: bool = False) -> Rows:
    """The training and held-out rows, checked against the reward functions, which are also called once
    on placeholder completions (``preflight_check``; with fresh ``environment`` instances, not reset)
    before any model loads. ``own_rollouts``: a rollout_func makes the completions, and may give the
    rewards columns of its own, so the first batch checks those."""
    dataset = train_dataset if train_dataset is not None else args.dataset
    source = dataset if isinstance(dataset, str) else "an in-memory dataset"
    stream = None
    if is_stream(dataset):  # checked on its first rows; trained on as it is read
        (dataset, stream), source = first_rows(dataset, STREAM_CHECK_ROWS), "the training stream"
    if train_dataset is None and "dataset" not in args.fields_given:  # the environment owns the data, as in TRL
        dataset, source, train = None, "the environment's reset()", environment_owned_rows(args, processes)
    else:
        train = load_rows(dataset, split=args.dataset_split, system_prompt=args.system_prompt,
                          config=args.dataset_config if train_dataset is None else None,
                          prompts_from_environment=environment is not None)
    if environment is not None:
        environment.check_rows(train, source)
    check_reward_columns(train, reward_funcs, source, others_may_come=own_rollouts)
    for func in reward_funcs:
        if isinstance(func, RewardModel):  # a chat needs a chat template to be scored as one text
            func.check_prompt(train[0]["prompt"])
    # the length of a run in epochs is known once prompts too long are dropped; this call sees an estimate
    steps = args.max_steps if args.max_steps != -1 else args.steps_for_epochs(len(train), processes)
    columns = extra_columns(train[:2])
    if environment is not None:
        columns["environments"] = environment.instances_for(train[:2])
    if not own_rollouts:
        preflight_check(reward_funcs, [r["prompt"] for r in train[:2]], columns, steps, args.reward_timeout)
    heldout = heldout_rows(dataset, eval_dataset if eval_dataset is not None else args.eval_dataset,
                           args.eval_max_samples, args.eval_split, args.system_prompt, args.dataset_config)
    if heldout and (shared := shared_prompts(train, heldout)):
        warn(f"{shared} of the {len(heldout)} held-out prompts are training prompts too, so the "
                      "before/after accuracy is not held-out; give eval_dataset (or eval_split) data the run does "
                      "not train on", stacklevel=3)
    if heldout:
        check_reward_columns(heldout, reward_funcs, "eval_dataset", others_may_come=own_rollouts)
    return Rows(source, train, heldout, stream)


def encode_training_prompts(args: GRPOConfig, tokenizer: Any, rows: list[dict], source: str,
                            agent: Agent | None = None, processor: Any = None
                            ) -> tuple[list[dict], list[list[int]], int]:
    """(the rows kept, their prompts' token ids, how many were over max_prompt_length): rows over it
    follow prompt_overflow. With an ``agent``, the prompts show the model its tools; prompts with pictures
    are written by the model's ``processor``."""
    overflowed: list[tuple[int, int]] = []
    prompts, tools = [r["prompt"] for r in rows], None
    if agent is not None:
        if (plain := next((i for i, p in enumerate(prompts) if isinstance(p, str)), None)) is not None:
            raise DataError(f"{source}, row {plain}: tools and environments need chat prompts (a list of messages): "
                            "a tool's result is a message of the conversation")
        shown = [agent.prompt(p, row) for p, row in zip(prompts, rows)]
        prompts, tools = [messages for messages, _ in shown], [tools for _, tools in shown]
    prompt_ids = encode_prompts(tokenizer, prompts, args.max_prompt_length, source, args.prompt_overflow,
                                overflowed, tools, args.chat_template_kwargs, processor)
    kept = [i for i, ids in enumerate(prompt_ids) if ids is not None]
    if not kept:
        raise DataError(f"every training prompt is longer than max_prompt_length={args.max_prompt_length}")
    if overflowed:
        action = "dropped" if args.prompt_overflow == "drop" else "cut to their last tokens"
        row, longest = max(overflowed, key=lambda pair: pair[1])
        warn(f"{len(overflowed)} training prompts were longer than max_prompt_length="
                      f"{args.max_prompt_length} and were {action}: up to {longest - args.max_prompt_length} tokens "
                      f"over (row {row}, {longest} tokens; first: row {overflowed[0][0]}); raise max_prompt_length "
                      "to keep them whole", stacklevel=3)
    return [rows[i] for i in kept], [prompt_ids[i] for i in kept], len(overflowed)


# ---- tools and environments ---------------------------------------------------------------------------


def environment_owned_rows(args: GRPOConfig, processes: int) -> list[dict]:
    """The rows of a run whose environment owns the data (no train_dataset): one round's worth of empty
    prompts, to which each episode's reset() adds its own (as TRL)."""
    return [{"prompt": EMPTY_PROMPT} for _ in range(args.prompts_per_round(processes))]


def load_environment(args: GRPOConfig, environment_factory: Callable | dict | None) -> Environments | None:
    """The environments of the run's episodes (given, else ``args.environment_factory``), probed: one
    instance of each is made to read its tools, as TRL does."""
    factory = environment_factory
    if factory is None and args.environment_factory:
        factory = load_reference(args.environment_factory, "environment_factory", ConfigError)
    return Environments.probe(factory) if factory is not None else None


def build_agent(args: GRPOConfig, tokenizer: Any, tools: Sequence | None, environment: Environments | None,
                tool_call_format: ToolCallFormat | None = None, processor: Any = None) -> Agent | None:
    """What the run's episodes run with: its tools (given, else ``args.tools``) and environment; None for
    a run of single completions."""
    specs = list(tools) if tools is not None else list(args.tools)
    if not specs and environment is None:
        return None
    return Agent.build(tokenizer, [tokenizer.eos_token_id], [load_tool(spec) for spec in specs], environment,
                       tool_call_format or FORMATS[args.tool_call_parser], args.max_tool_calling_iterations,
                       args.tool_timeout, args.chat_template_kwargs, processor)


# ---- the policy and its optimizer -----------------------------------------------------------------


def model_loading(args: GRPOConfig) -> ModelLoading:
    """How the config's model is loaded (by the trainer, the engines, ``covey eval`` and ``covey server``)."""
    return ModelLoading(args.trust_remote_code, args.model_revision, args.dtype, args.attn_implementation,
                        args.quantization, args.bnb_4bit_quant_type, args.use_bnb_nested_quant,
                        tuple((args.model_init_kwargs or {}).items()), args.use_cpu)


def check_model_settings(args: GRPOConfig, model: Any, peft_config: Any) -> None:
    """The model settings that only make sense for a model loaded by name, or with a LoRA adapter: checked
    before anything loads."""
    by_name = model is None or isinstance(model, str)
    if not by_name:
        given = [name for name in ("model_init_kwargs", "load_in_4bit", "load_in_8bit", "attn_implementation")
                 if getattr(args, name)] + (["model_revision"] if args.model_revision != "main" else []) + (
                     ["dtype"] if args.dtype != "float32" else [])
        if given:
            raise ConfigError(f"{', '.join(given)} say how a model is loaded, and this one was handed over loaded: "
                              "load it so yourself, or pass the model by name")
    if args.quantization and not uses_lora(args, model, peft_config):
        raise ConfigError(f"load_in_{args.quantization} loads weights that cannot be trained: train a LoRA adapter "
                          "on them (use_peft: true, or peft_config=)")
    check_quantization(args.quantization)


def uses_lora(args: GRPOConfig, model: Any, peft_config: Any) -> bool:
    """Whether the policy trains a LoRA adapter: asked for (use_peft, peft_config), handed over with one,
    or loaded from a saved adapter's folder."""
    by_name = model is None or isinstance(model, str)
    return args.use_peft or peft_config is not None or is_peft_model(model) or (
        by_name and (Path(resolve_model_path(model or args.model)) / "adapter_config.json").is_file())


def build_policy(args: GRPOConfig, model: Any, peft_config: Any) -> torch.nn.Module:
    """The model to train: loaded if given by name, wrapped in LoRA when asked."""
    if isinstance(model, torch.nn.Module):
        policy = model.cpu() if args.use_cpu else model
    else:
        policy = load_policy(model or args.model, model_loading(args))
    if (args.use_peft or peft_config is not None) and not is_peft_model(policy):
        if args.quantization:  # float32 norms and embeddings, inputs that carry gradients (peft's recipe)
            from peft import prepare_model_for_kbit_training

            policy = prepare_model_for_kbit_training(policy, use_gradient_checkpointing=args.gradient_checkpointing)
        if peft_config is not None:
            from peft import get_peft_model

            policy = get_peft_model(policy, peft_config)
        else:
            policy = add_lora(policy, args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules,
                              modules_to_save=args.lora_modules_to_save, use_rslora=args.use_rslora,
                              use_dora=args.use_dora, **vision_lora_options(policy, args.train_vision_tower))
    if is_vision_model(policy) and not args.train_vision_tower and not is_peft_model(policy):
        freeze_vision_parts(policy)  # full fine-tuning of the language model alone (adapters: vision_lora_options)
    if args.cast_lm_head_to_fp32:
        head_in_float32(policy)
    if shared := adapted_shared_matrix(policy):
        warn(f"the LoRA adapter on {shared} changes a matrix the input embedding and the output head "
                      "share: the adapter trains and saves exactly, and covey export gives a model with the two "
                      "untied, but peft's merge_and_unload changes both, and vLLM or a covey server (which hold "
                      f"them tied) cannot sample with it; leave {shared.rpartition('.')[2]} out of "
                      "lora_target_modules to avoid both", stacklevel=3)
    if args.disable_dropout:
        disable_dropout(policy)
    if args.gradient_checkpointing:  # transformers' newer name where it has it
        (getattr(policy, "activation_checkpointing_enable", None) or policy.gradient_checkpointing_enable)()
    return policy


# the engines that sample in the training process, from a whole copy of a sharded policy
ENGINES_IN_PROCESS = ("fast", "hf")


@dataclass(frozen=True)
class ShardedRun:
    """A run's passes under fsdp (``covey.train.sharding``): around the policy, and around the frozen
    reference (None: no reference, or LoRA's, which is the policy with its adapter off), and the whole
    copy of the policy that an engine in this process samples from (None for the others)."""

    policy_pass: torch.nn.Module
    reference_pass: torch.nn.Module | None
    policy_copy: PolicyCopy | None


def shard_run(args: GRPOConfig, sharding: Sharding, policy: torch.nn.Module, reference: Reference | None,
              own_engine: bool, world: World, logprob_budget: int) -> ShardedRun:
    """The policy and the frozen reference sharded over the processes (each wrapped in the pass that runs
    it, the root unit, with ``logprob_budget``); ``own_engine``: the run brings its own engine (no copy is
    made for it). In one process nothing is sharded, but the run is one (its checkpoints are shards, of one
    process)."""
    one = world.size == 1
    copy = None if one or own_engine or engine_name(args) not in ENGINES_IN_PROCESS else PolicyCopy(policy)  # first

    def wrapped(model: torch.nn.Module, trained: bool) -> torch.nn.Module:
        logprob_pass = TrainingForward(model, logprob_budget)
        return logprob_pass if one else shard(logprob_pass, sharding, args.bf16, trained)

    frozen = None if reference is None else reference.frozen
    return ShardedRun(wrapped(policy, True), None if frozen is None else wrapped(frozen, False), copy)


def make_optimizer(args: GRPOConfig, model: torch.nn.Module, world: World) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; under shard_optimizer_state with several processes, each
    process keeps the state of (and updates) a share of them, and sends its updated share to the others."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    # the fused kernel updates each tensor in one pass over its memory (the same numbers, a quarter of the time)
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in trainable)
    settings = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                    weight_decay=args.weight_decay, fused=fused or None)
    if args.shard_optimizer_state and world.size > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if len(kinds := {(p.dtype, p.device) for p in trainable}) > 1:
            raise ConfigError(f"shard_optimizer_state needs every trained parameter in one dtype on one device; "
                              f"this model's are {sorted(map(str, kinds))}: cast the model to one dtype, or turn "
                              "shard_optimizer_state off")
        return ZeroRedundancyOptimizer(trainable, optimizer_class=torch.optim.AdamW, **settings)
    return torch.optim.AdamW(trainable, **settings)


def given_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The user's own optimizer (TRL's ``optimizers[0]``), once it is known to update the policy: every
    parameter it holds is one of the policy's trained ones."""
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if not held or any(id(p) not in trained for p in held):
        raise ConfigError("optimizers[0] holds parameters the policy does not train (built on another model, or "
                          "before covey added the LoRA adapter of peft_config / use_peft?); build it on "
                          "[p for p in model.parameters() if p.requires_grad] of the model you hand over, already "
                          "adapted, or leave optimizers out")
    return optimizer


def lr_schedule(args: GRPOConfig) -> Callable[[int], float]:
    """The learning rate's factor at each optimizer step: linear warmup (warmup_steps or warmup_ratio),
    then the chosen decay."""
    warmup, kwargs = args.warmup_optimizer_steps, args.lr_scheduler_kwargs or {}
    # cosine_with_min_lr: cosine down to a floor, as a fraction of learning_rate (transformers' min_lr_rate)
    floor = kwargs.get("min_lr_rate", kwargs.get("min_lr", 0.0) / args.learning_rate if args.learning_rate else 0.0)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, args.max_steps - warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return {"constant": 1.0, "linear": 1.0 - progress, "cosine": cosine,
                "cosine_with_min_lr": floor + (1.0 - floor) * cosine}[args.lr_scheduler_type]

    return factor


# ---- the settings of the stages ---------------------------------------------------------------------


def sampling_params(args: GRPOConfig) -> SamplingParams:
    """How the training rounds sample."""
    return SamplingParams(args.max_completion_length, args.temperature, args.top_p, args.top_k, args.min_p or 0.0,
                          args.repetition_penalty, tuple(args.stop_strings or ()),
                          extra=tuple((args.generation_kwargs or {}).items()))


def check_vocabulary(policy: torch.nn.Module, tokenizer: Any) -> None:
    """The model has an embedding row for every token id its tokenizer can produce (a larger table, padded
    for speed, is common and fine)."""
    embeddings = plain_model(policy).get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens and the model's embedding only {rows} rows: "
                          "they do not belong together; give the model's own tokenizer (processing_class)")


def router_aux_loss_coef(args: GRPOConfig, policy: torch.nn.Module) -> float:
    """The weight of a mixture-of-experts model's load-balancing loss: the config's, else (None) the
    architecture's own (0 where it declares none), as TRL; a weight for a model without a router is refused."""
    config = getattr(plain_model(policy), "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    has_router = hasattr(text, "output_router_logits")
    if args.router_aux_loss_coef and not has_router:
        raise ConfigError(f"router_aux_loss_coef={args.router_aux_loss_coef} weighs a mixture-of-experts router's "
                          f"load-balancing loss, and {type(plain_model(policy)).__name__} is not a Mixture-of-Experts "
                          "model; remove it")
    coef = getattr(text, "router_aux_loss_coef", 0.0) if args.router_aux_loss_coef is None else args.router_aux_loss_coef
    return float(coef or 0.0) if has_router else 0.0


def loss_settings(args: GRPOConfig, router_aux_loss_coef: float = 0.0) -> core.LossSettings:
    entropy_bonus = core.EntropyBonus(args.entropy_coef, args.use_adaptive_entropy, args.entropy_target,
                                      args.entropy_coef_delta, args.entropy_coef_min, args.entropy_coef_max)
    return core.LossSettings(
        loss_type=args.loss_type, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high, delta=args.delta,
        clip_ratio_c=args.clip_ratio_c, importance_sampling_level=args.importance_sampling_level, beta=args.beta,
        kl_estimator=args.kl_estimator, use_bias_correction_kl=args.use_bias_correction_kl,
        top_entropy_quantile=args.top_entropy_quantile, sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
        vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg,
        off_policy_mask_threshold=args.off_policy_mask_threshold, entropy_bonus=entropy_bonus,
        router_aux_loss_coef=router_aux_loss_coef)


def engine_correction(args: GRPOConfig) -> core.EngineCorrection | None:
    """The engine/trainer importance-sampling correction for engines whose log-probs are not exact
    (None where the config turns it off)."""
    if not args.vllm_importance_sampling_correction:
        return None
    return core.EngineCorrection.from_mode(args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_max,
                                           args.vllm_importance_sampling_clip_min)


def engine_name(args: GRPOConfig) -> str:
    """The key of ``covey.rollout.ENGINES`` the config asks for."""
    if args.rollout_engine == "vllm" and args.vllm_mode == "server":
        return "server"
    return args.rollout_engine


def engine_settings(args: GRPOConfig, device: torch.device) -> EngineSettings:
    """What the engines are built with, for a policy on ``device``."""
    return EngineSettings(bf16=args.sample_in_bf16(device), dtype="bfloat16" if args.bf16 else "float32",
                          seed=args.seed, max_model_len=args.max_prompt_length + args.max_completion_length,
                          gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                          trust_remote_code=args.trust_remote_code, sleep_mode=args.vllm_enable_sleep_mode,
                          server_host=args.vllm_server_host,
                          server_port=args.vllm_server_port, server_timeout=args.vllm_server_timeout,
                          group_port=args.vllm_group_port)


def check_engine(engine: RolloutEngine, episodes: bool) -> None:
    """An engine handed to the trainer has every member of the interface the trainer uses (``episodes``:
    the run samples episodes of several turns)."""
    if missing := missing_members(engine, episodes):
        raise ConfigError(f"rollout_engine {type(engine).__name__} lacks {', '.join(missing)} of covey.rollout.RolloutEngine; "
                          "derive it from covey.rollout.SamplesWithPolicy (an engine that samples with the policy module "
                          "itself) or covey.rollout.OwnWeights (one with a copy of the weights, pushed to it)")


def build_engine(args: GRPOConfig, policy: torch.nn.Module, tokenizer: Any, eos_ids: list[int]) -> RolloutEngine:
    """The rollout engine the config asks for, over ``policy``."""
    settings = engine_settings(args, next(policy.parameters()).device)
    return make_engine(engine_name(args), settings, policy, tokenizer, eos_ids)


def server_backend(args: GRPOConfig) -> FastBackend:
    """What ``covey server --backend fast`` serves for a run's config: the fast engine over its model."""
    tokenizer = load_tokenizer(args.model, args.trust_remote_code, args.model_revision)
    # a saved adapter is merged: the server holds plain weights, as the trainer pushes them
    model = merged_model(load_policy(args.model, dataclasses.replace(model_loading(args), quantization=None)))
    return FastBackend(model.eval(), tokenizer, eos_token_ids(model, tokenizer),
                       args.sample_in_bf16(next(model.parameters()).device), name=args.model)


def vllm_serve(args: GRPOConfig, host: str, port: int) -> VLLMServe:
    """``vllm serve`` for a run's config (``covey server --backend vllm``), checked first: vLLM in the
    tested range, a seed it takes, a model it can load."""
    rules.check((rules.vllm_seed,), args)
    path = resolve_model_path(args.model)
    if (Path(path) / "adapter_config.json").is_file():
        raise ConfigError(f"{path} is a LoRA adapter, which vLLM cannot load as a model; start the server with "
                          "the adapter's base model as `model` (the trainer pushes the merged weights)")
    check_vllm(model_path=path)
    transfer = "nccl" if torch.cuda.is_available() else BACKEND
    settings = engine_settings(args, torch.device("cpu"))  # what the colocated engine would be built with
    return vllm_serve_command(path, host, port, settings.dtype, settings.seed, settings.max_model_len,
                              settings.gpu_memory_utilization, settings.trust_remote_code, server_token(), transfer)


def one_batch_settings(args: GRPOConfig, num_prompts: int, **changes: Any) -> GRPOConfig:
    """``args`` for sampling and scoring one batch of ``num_prompts`` prompts without training: nothing
    is written (no run folder unless train() runs, no evaluation) or pushed to the Hub. A length in
    epochs becomes one step."""
    if args.max_steps == -1:
        changes = {"max_steps": 1, "num_train_epochs": None, **changes}
    settings = args.replace(output_dir=None, resume_from_checkpoint=None, eval_max_samples=0, push_to_hub=False,
                            gradient_accumulation_steps=1, per_device_train_batch_size=num_prompts * args.num_generations,
                            steps_per_generation=None, **changes)
    # what the caller set stays told apart from covey's defaults (such as the engine of prompts with pictures)
    settings.__dict__["fields_given"] = args.fields_given | set(changes)
    return settings

