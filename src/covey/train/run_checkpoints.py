"""A run's checkpoints: its state (``RunState``) and its parts' (weights, optimizer, schedule, the
sampler's position) written between steps, with every process's part (random states, shards of a
sharded optimizer or model, the rounds an asynchronous worker sampled ahead), and taken back when a
run resumes. The files' layout and their atomic writing are ``covey.train.checkpoint``'s."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from covey.errors import CheckpointError, warn
from covey.models import tokenizer_as_loaded
from covey.train import setup
from covey.train.assemble import Assembled
from covey.train.checkpoint import IN_FLIGHT, load_checkpoint, rng_states, save_checkpoint, save_sharded, sharded_staging
from covey.train.distributed import sharded_part
from covey.train.run_state import RunState
from covey.train.sharding import whole_state_dict


def checkpoint_every_process(run: Assembled, state: RunState) -> Path:
    """A checkpoint, written by the first process with what the others send it: their random states
    (each resumes its own streams), their parts of a sharded optimizer state, and under
    async_generation the rounds each process's worker sampled ahead, the worker held meanwhile (its
    prompt sampler at the worker's position; a resumed run trains those rounds next). Its path."""
    worker = run.parts.sampler.ahead
    with worker.held() if worker is not None else contextlib.nullcontext() as in_flight:
        return _write_checkpoint(run, state, run.world.gather(in_flight) if worker is not None else None)


def _write_checkpoint(run: Assembled, state: RunState, in_flight: list | None) -> Path:
    """The checkpoint as this run's layout writes it (whole, sharded, or the model alone), with
    ``in_flight``: each process's rounds sampled ahead (None without async_generation)."""
    world, parts = run.world, run.parts
    if run.args.save_only_model:  # the model alone, whole (gathered first where it is sharded)
        whole = whole_model_state(run)
        return world.on_main(lambda: write_checkpoint_here(run, state, model_state=whole, in_flight=in_flight))
    if parts.policy.sharded_pass is not None:  # every process writes its shards, then the first the rest
        staging = world.on_main(lambda: sharded_staging(run.run_dir, state.global_step))
        save_sharded(staging, parts.policy.sharded_pass, parts.policy.optimizer,
                     parts.policy.sharded_reference_pass if moving_reference(run) is not None else None)
        with_model = run.sharding.whole_model_in_checkpoints  # state_dict_type: FULL_STATE_DICT
        whole = whole_model_state(run) if with_model else None
        process_rngs = world.gather(rng_states())
        return world.on_main(lambda: write_checkpoint_here(run, state, process_rngs[1:], sharded=staging,
                                                           model_state=whole, whole_model=with_model,
                                                           in_flight=in_flight))
    sharded = sharded_part(parts.policy.optimizer) is not None
    optimizer_state = world.gather_optimizer_state(parts.policy.optimizer) if sharded else None
    process_rngs = world.gather(rng_states())
    return world.on_main(lambda: write_checkpoint_here(run, state, process_rngs[1:], optimizer_state,
                                                       in_flight=in_flight))


def write_checkpoint_here(run: Assembled, state: RunState, other_processes_rng: list = (), optimizer_state: dict | None = None,
                          sharded: Path | None = None, model_state: dict | None = None, whole_model: bool = False,
                          in_flight: list | None = None) -> Path:
    """Write checkpoints/checkpoint-<step> (atomically) from this process and prune old ones; its path.
    ``other_processes_rng``: the random states of the other processes, which it then holds too;
    ``optimizer_state``: the whole state of a sharded optimizer (by default the optimizer's own);
    ``sharded``, ``model_state``: under fsdp, the folder of the processes' shards, and the whole
    model's state dict (under save_only_model, or ``whole_model``: model/ beside the shards);
    ``in_flight``: under async_generation, each process's rounds sampled ahead (``AsyncGeneration.held``).
    Under save_only_model: the model alone."""
    policy = run.parts.policy
    saved = {**state.saved(), "sampler": run.prompt_sampler.state_dict(), "scheduler": policy.scheduler.state_dict(),
             "processes": run.world.size}
    whole = not run.args.save_only_model
    with tokenizer_as_loaded(run.parts.sampler.tokenizer) as tokenizer:
        return save_checkpoint(run.run_dir, state.global_step, policy.model,
                               (optimizer_state or policy.optimizer.state_dict()) if whole and sharded is None else None,
                               saved, moving_reference(run), run.args.save_total_limit, tokenizer,
                               other_processes_rng, sharded, model_state, whole_model, in_flight,
                               run.parts.sampler.processor)


def restore(run: Assembled, path: Path) -> RunState:
    """Take the run's parts back to the checkpoint at ``path`` (the weights, the optimizer, the schedule,
    the sampler's position); the run's state there (progress, the metrics logged so far, the rounds in
    flight)."""
    args, world, parts = run.args, run.world, run.parts
    try:
        saved = load_checkpoint(path, parts.policy.model, parts.policy.optimizer, moving_reference(run), world.rank,
                                parts.policy.sharded_pass, parts.policy.sharded_reference_pass)
        parts.policy.scheduler.load_state_dict(saved["scheduler"])
        run.prompt_sampler.load_state_dict(saved["sampler"])
        in_flight_file = path / IN_FLIGHT  # async_generation: each process's rounds sampled ahead
        in_flight = torch.load(in_flight_file, weights_only=False) if in_flight_file.is_file() else None
        mine = None if in_flight is None or len(in_flight) != world.size else in_flight[world.rank]
        state = RunState.start(args).restored(saved, args, mine)
        saved_processes = saved.get("processes", 1)
    except CheckpointError:
        raise
    except Exception as e:  # a damaged checkpoint, or one a different setup wrote
        raise CheckpointError(f"could not resume from {path}: {type(e).__name__}: {e}. It is damaged or was "
                              "written by a different setup (model, LoRA settings); resume from an earlier "
                              "checkpoint or start a new run") from None
    if in_flight is not None and len(in_flight) != world.size and args.async_generation:
        raise CheckpointError(f"{path} holds the rounds {len(in_flight)} process(es) sampled ahead under "
                              f"async_generation, each its share of the prompts, and this run has {world.size}: "
                              f"resume with {len(in_flight)} process(es), or from a checkpoint of a synchronous run")
    if in_flight is not None and not args.async_generation:
        warn(f"{path} holds {len(in_flight[0]['rounds'])} round(s) sampled ahead under "
                      "async_generation, which this run (async_generation: false) does not train: the run does "
                      "not continue as it would have; resume with async_generation: true for that", stacklevel=3)
    if saved_processes != world.size:
        warn(f"{path} was written by a run of {saved_processes} process(es) and this one has "
                      f"{world.size}: each optimizer step now takes the prompts of {world.size}, so "
                      "the run does not continue as it would have", stacklevel=3)
    if not run.prompt_sampler.resumes_over(len(parts.prompts.rows)):
        raise CheckpointError(f"{path} was written while training on a larger dataset than this run's "
                              f"{len(parts.prompts.rows)} rows; resume with the same dataset")
    # the learning rate is this run's config too (max_steps and the schedule already are)
    parts.policy.scheduler.base_lrs = [args.learning_rate for _ in parts.policy.scheduler.base_lrs]
    for group in parts.policy.optimizer.param_groups:
        group["initial_lr"] = args.learning_rate
        group["lr"] = args.learning_rate * setup.lr_schedule(args)(parts.policy.scheduler.last_epoch)
    return state


def moving_reference(run: Assembled) -> torch.nn.Module | None:
    """The reference model when sync_ref_model moves it (then a checkpoint must carry it), else None."""
    reference = run.parts.policy.reference
    return reference.frozen if reference is not None and run.args.sync_ref_model else None


def whole_model_state(run: Assembled) -> dict | None:
    """Under fsdp, the policy's whole state dict on the first process (every process takes part); else
    None, where the model writes its own."""
    return None if run.parts.policy.sharded_pass is None else whole_state_dict(run.parts.policy.sharded_pass)
