"""A run assembled from what ``GRPOTrainer`` was handed: the rules of the run checked, then the
rewards, the rows, the run folder, the tokenizer and prompts, the policy and its reference, the
rollout engine, the optimizer, and the step's parts (``StepParts``: the policy and the sampler among them). Nothing loads before the rules
of the run (``covey.train.run_rules``) have passed."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from covey.rules import check
from covey.config import GRPOConfig
from covey.data import PromptSampler, RowStream, StreamOrder, load_rows
from covey.errors import ConfigError
from covey.models import Reference, eos_token_ids, load_processing, plain_model, prepare_tokenizer, set_log_level
from covey.rewards import ProbeReport, RewardPool
from covey.train import setup
from covey.train.batch import Prompts
from covey.train.checkpoint import resolve_checkpoint, saved_step
from covey.train.distributed import World
from covey.train.hub import HubPush
from covey.train.run_folder import config_as_used, make_run_dir
from covey.train.run_rules import ENGINE_ROW_RULES, ENGINE_RULES, ROW_RULES, RUN_RULES, Handed
from covey.train.sharding import Sharding
from covey.train.parts import Rewards, StepParts
from covey.train.policy import Policy, logprob_budget_for
from covey.train.reward_probing import probe_before_training
from covey.train.sampler import Sampler
from covey.train.trl_api import named_eval_sets
from covey.train.vision_run import picture_sampling, with_picture_engine
from covey.vision import has_images, processor_of, text_tokenizer
from covey.vision.fit import check_processor_fits


# a streamed dataset's rows held: those of this many rounds (each with its refills under dynamic sampling)
STREAM_WINDOW_ROUNDS = 4


@dataclass(frozen=True)
class Assembled:
    """A run, ready to train: its step's parts and what the trainer keeps beside them."""

    args: GRPOConfig  # max_steps set where num_train_epochs gave the length
    parts: StepParts
    world: World
    sharding: Sharding | None  # None: not sharded
    prompt_sampler: PromptSampler | StreamOrder
    run_dir: Path
    hub: HubPush | None  # None but in the first process under push_to_hub
    resume_from: Path | None
    config_as_used: dict
    eval_rows: list[dict] | None
    dataset_name: str
    model_name: str
    prompt_overflow_count: int
    reward_probes: ProbeReport | None  # None: not probed (reward_probes false, a rollout_func, not the first process)


def assemble(args: GRPOConfig, handed: Handed, eval_dataset: Any, reward_processing_classes: Any,
             rollout_func: Callable[[list], dict] | None) -> Assembled:
    """The run ``handed`` describes under ``args``; ``rollout_func`` takes the prompts alone (the
    trainer is bound in already)."""
    check(RUN_RULES, args, handed)
    world = World.from_environment(args.ddp_timeout)
    sharding = Sharding.from_settings(args.fsdp, args.fsdp_config, os.environ)
    set_log_level(args.log_level)
    reward_funcs = handed.reward_funcs
    if callable(reward_funcs) or isinstance(reward_funcs, str):
        reward_funcs = [reward_funcs]
    funcs, weights = setup.load_rewards(args, reward_funcs, reward_processing_classes)
    probed = list(funcs)  # an environment's own rewards (below) score its episodes: not probed
    environment = setup.load_environment(args, handed.environment_factory)
    if environment is not None:  # environments that score their episodes (get_reward) are rewards too (TRL's)
        scored = environment.reward_functions()
        funcs, weights = [*funcs, *scored], [*weights, *[1.0] * len(scored)]
    if not funcs:
        raise ConfigError("No reward source provided: reward_funcs is empty, and no environment defines "
                          "get_reward; give reward_funcs=[...] or define get_reward")
    as_used = config_as_used(args, handed.model, handed.train_dataset, eval_dataset, reward_funcs, handed.peft_config,
                             handed.tools, handed.environment_factory)
    rewards = Rewards(funcs, weights, RewardPool(funcs, args.reward_num_workers, args.num_generations))
    if eval_dataset is not None:  # several named sets (a dict, a DatasetDict) are evaluated together
        eval_dataset = [dict(row) for rows in named_eval_sets(eval_dataset).values() for row in rows]
    rows = setup.load_run_rows(args, handed.train_dataset, eval_dataset, funcs, world.size, environment,
                               own_rollouts=rollout_func is not None)
    args = with_picture_engine(args, rows.train)  # prompts with pictures: transformers' generate unless asked
    check(ROW_RULES, args, dataclasses.replace(handed, train_dataset=rows.train))
    if args.eval_strategy == "steps" and not rows.heldout:
        raise ConfigError(f"eval_strategy: steps evaluates on held-out data, and {rows.source} brings none: give "
                          "eval_dataset (or a built-in task), or set eval_strategy: no")
    resume_from = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir) if args.resume_from_checkpoint else None
    if args.max_steps != -1:
        check_resumed_step(resume_from, args.max_steps)
    run_dir = world.on_main(lambda: make_run_dir(args, resume_from))
    hub = HubPush.connect(args, run_dir, world)
    torch.manual_seed(world.seed(args.seed))  # dropout masks of its own in each process

    # the text stages' tokenizer, and a vision-language model's processor for the prompts with pictures
    tokenizer, processor = text_tokenizer(handed.processing_class), processor_of(handed.processing_class)
    if tokenizer is not None:
        prepare_tokenizer(tokenizer)
    else:
        tokenizer, processor = load_processing(handed.model_source(args), args.trust_remote_code, args.model_revision,
                                               pictures=has_images(rows.train))
    agent = setup.build_agent(args, tokenizer, handed.tools, environment, handed.tool_call_format, processor)
    train_rows, prompt_ids, overflow = setup.encode_training_prompts(args, tokenizer, rows.train, rows.source, agent,
                                                                     processor)
    probes = (probe_before_training(args, probed, train_rows, tokenizer)  # warns, never stops the run
              if args.reward_probes and rollout_func is None and world.is_main else None)
    if args.max_steps == -1:  # num_train_epochs passes over the prompts kept, as a number of steps from here on
        args = args.replace(max_steps=args.steps_for_epochs(len(train_rows), world.size),
                                   num_train_epochs=None)
        check_resumed_step(resume_from, args.max_steps)

    model = handed.model
    policy = setup.build_policy(args, model, handed.peft_config)
    if processor is not None:  # its image tokens and the vision tower's features agree (before the vocabularies)
        check_processor_fits(plain_model(policy), processor, prompt_ids)
    setup.check_vocabulary(policy, tokenizer)
    world.check_device(next(policy.parameters()).device)
    world.broadcast_parameters(policy)
    reference = Reference(policy) if args.beta > 0 else None
    eos_ids = eos_token_ids(policy, tokenizer)
    if agent is not None:  # a turn ends at any of the model's end tokens
        agent = dataclasses.replace(agent, eos_ids=eos_ids)
    given_engine = handed.rollout_engine
    logprob_budget = logprob_budget_for(args, policy, world)
    sharded = (None if sharding is None else
               setup.shard_run(args, sharding, policy, reference, given_engine is not None, world, logprob_budget))
    sampled = policy if sharded is None or sharded.policy_copy is None else sharded.policy_copy.model
    engine = given_engine or setup.build_engine(args, sampled, tokenizer, eos_ids)
    check(ENGINE_RULES, args, engine, rollout_func is not None)
    check(ENGINE_ROW_RULES, engine, rows.train, policy)
    if given_engine is not None or (world.size > 1 and engine.shared_by_processes):
        # whatever it holds, it samples from the policy: pushed before sampling (by the first process)
        engine.policy_changed(policy)
    optimizer, scheduler = handed.optimizers  # the user's own (TRL's optimizers=), else covey's
    optimizer = setup.make_optimizer(args, policy, world) if optimizer is None else setup.given_optimizer(optimizer, policy)
    scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(optimizer, setup.lr_schedule(args))
    # the prompts of every process, drawn together; each takes its share (World.share)
    prompts = Prompts(train_rows, prompt_ids)
    prompt_sampler = PromptSampler(len(train_rows), args.prompts_per_round(world.size), args.seed, args.shuffle_dataset)
    if rows.stream is not None:  # read as the rounds ask, from its first row; the rows checked above were its first
        def prepare(chunk: list[dict]) -> tuple[list[dict], list[list[int]]]:
            chunk = load_rows(chunk, system_prompt=args.system_prompt, prompts_from_environment=environment is not None)
            return setup.encode_training_prompts(args, tokenizer, chunk, rows.source, agent, processor)[:2]

        per_round = args.prompts_per_round(world.size)
        stream = RowStream(rows.stream, prepare, STREAM_WINDOW_ROUNDS * per_round * (1 + args.dynamic_sampling_max_rounds))
        prompts, prompt_sampler = Prompts(stream.rows, stream.ids), StreamOrder(stream, per_round)
    sampler = Sampler(engine, tokenizer, eos_ids, picture_sampling(setup.sampling_params(args), policy),
                      setup.engine_correction(args), agent,
                      rollout_func, None if sharded is None else sharded.policy_copy, args.async_generation,
                      processor)
    sharded_passes = () if sharded is None else (sharded.policy_pass, sharded.reference_pass)
    policy_parts = Policy(policy, reference, optimizer, scheduler, *sharded_passes,
                          logprob_budget_bytes=logprob_budget)
    parts = StepParts(args, world, policy_parts, sampler, prompts, rewards,
                      setup.loss_settings(args, setup.router_aux_loss_coef(args, policy)))
    if model is None or isinstance(model, str):
        model_name = model or args.model
    else:
        model_name = getattr(getattr(model, "config", None), "_name_or_path", None) or "a model object"
    return Assembled(args, parts, world, sharding, prompt_sampler, run_dir, hub, resume_from, as_used, rows.heldout,
                     rows.source, model_name, overflow, probes)


def check_resumed_step(resume_from: Path | None, max_steps: int) -> None:
    """A checkpoint to resume from is not past the run's last step."""
    if resume_from is not None and (resumed_at := saved_step(resume_from)) > max_steps:
        raise ConfigError(f"{resume_from} is at step {resumed_at}, beyond max_steps={max_steps}: raise max_steps to "
                          "continue the run, or resume from an earlier checkpoint")
