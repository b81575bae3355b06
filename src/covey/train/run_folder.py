"""The run folder: where a run writes, the config it saves there (as used), and the guard that
nothing the user made is overwritten: a used folder is refused unless the run resumes
there or is told to overwrite, and then only a previous run's own outputs are cleared."""

from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import yaml

from covey.agents import BUILTIN_TOOLS
from covey.config import GRPOConfig, config_fields
from covey.errors import ConfigError
from covey.rewards import reward_reference
from covey.sources import in_memory
from covey.train.checkpoint import CHECKPOINTS, checkpoint_dirs, saved_step, step_of
from covey.train.hub import STAGING


def config_as_used(args: GRPOConfig, model: Any, train_dataset: Any, eval_dataset: Any,
                   reward_funcs: Sequence | None, peft_config: Any, tools: Sequence | None = None,
                   environment_factory: Any = None) -> dict:
    """The config a run saves: ``args`` with what the trainer was handed in their place (model,
    datasets, reward functions, a LoRA config, tools, an environment class). What a file cannot name (a
    model object, in-memory rows, a function defined in a script) becomes a marker that says so and
    loads nothing, rather than the default the run did not use."""
    values = args.to_dict()
    values["hub_token"] = None  # a secret: never written (a run of the saved config pushes with the login's token)
    if model is not None:
        name = getattr(getattr(model, "config", None), "_name_or_path", None)
        origin = f" from {name}" if name else ""
        values["model"] = model if isinstance(model, str) else in_memory(f"{type(model).__name__}{origin}")
    for key, given in (("dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if given is not None:
            values[key] = given if isinstance(given, str) else in_memory("dataset")
    if reward_funcs is not None:
        values["reward_funcs"] = [reward_reference(f) for f in reward_funcs]
    if tools is not None:  # by name, reference, or a marker (as reward functions are)
        values["tools"] = [t if isinstance(t, str) else next((name for name, f in BUILTIN_TOOLS.items() if f is t),
                                                             None) or reward_reference(t) for t in tools]
    if environment_factory is not None:
        values["environment_factory"] = reward_reference(environment_factory)
    if peft_config is not None:
        values["use_peft"] = True
        if all(hasattr(peft_config, key) for key in ("r", "lora_alpha", "lora_dropout")):  # a LoRA config
            targets = peft_config.target_modules
            values.update(lora_r=peft_config.r, lora_alpha=peft_config.lora_alpha, lora_dropout=peft_config.lora_dropout)
            if targets:
                values["lora_target_modules"] = [targets] if isinstance(targets, str) else sorted(targets)
    return values


def make_run_dir(args: GRPOConfig, resume_from: Path | None = None) -> Path:
    """The run folder; refuses to write into one that already holds files unless told to or resuming
    (a checkpoint given without output_dir continues in the run folder it belongs to)."""
    if resume_from is not None:
        own_run = resume_from.parent.parent
        if args.output_dir is None and not (resume_from.parent.name == CHECKPOINTS and (own_run / "config.yaml").is_file()):
            raise ConfigError(f"{resume_from} does not lie in the {CHECKPOINTS}/ folder of a run, so there is no run "
                              "folder to continue in; give --output-dir, the folder to continue in")
        run_dir = Path(args.output_dir).resolve() if args.output_dir else own_run
        if run_dir != own_run:  # a new branch of the run: the usual guard applies
            _refuse_a_used_folder(run_dir, args)
        later = [p.name for p in checkpoint_dirs(run_dir) if step_of(p) > saved_step(resume_from)]
        if later:
            raise ConfigError(f"{run_dir} holds checkpoints after {resume_from.name} ({', '.join(later)}): continuing "
                              f"from {resume_from.name} there would mix two histories. Give a new --output-dir for "
                              "this branch, or move the later checkpoints away")
        return run_dir
    if args.output_dir is None:
        return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")  # made unique when claimed
    run_dir = Path(args.output_dir)
    _refuse_a_used_folder(run_dir, args)
    return run_dir


def _refuse_a_used_folder(run_dir: Path, args: GRPOConfig) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"output_dir {run_dir} is a file, not a folder; give the folder the run should write in")
    if not (run_dir.exists() and any(run_dir.iterdir())):
        return
    if not args.overwrite_output_dir:
        raise ConfigError(f"output_dir {run_dir} already holds files; choose a new output_dir "
                          "(nothing is overwritten unless you pass --overwrite-output-dir true)")
    config = run_dir / "config.yaml"
    if config.exists() and not _saved_by_a_run(config):
        raise ConfigError(f"{config} was not saved by a covey run (your own config?), and overwrite_output_dir would "
                          "replace it: move it out of the folder (or, if an older covey run wrote it, delete it), or "
                          "choose a new output_dir")


# the first line of every config a run saves: what tells it from a config the user wrote
RUN_CONFIG_HEADER = "# the settings of a covey run, as it used them (written by covey)\n"


def write_run_config(path: Path, values: dict) -> None:
    path.write_text(RUN_CONFIG_HEADER + yaml.safe_dump(values, sort_keys=False))


def _saved_by_a_run(config: Path) -> bool:
    """Whether a run folder's config.yaml is a run's own: it starts with the header runs write, or is
    empty (a run that stopped before saving it), or, from runs of versions before the header, holds
    nearly every config field beside the run's other outputs."""
    try:
        text = config.read_text()
        saved = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    if text.startswith(RUN_CONFIG_HEADER) or saved is None:
        return True
    fields = {f.name for f in config_fields()}
    beside = any(next(config.parent.glob(pattern), None) for pattern in RUN_OUTPUTS if pattern != "config.yaml")
    return isinstance(saved, dict) and beside and len(fields & set(saved)) >= 0.9 * len(fields)


# what a run writes in its folder: what overwrite_output_dir clears (nothing else there is touched)
RUN_OUTPUTS = ("config.yaml", "config.resumed-at-*.yaml", "metrics.jsonl", "completions.jsonl", "summary.json",
               "final_model", ".tmp-final_model-*", ".old-final_model-*", CHECKPOINTS, "tensorboard", "wandb", "mlflow.db",
               "mlartifacts", f"{STAGING}*")


def claim_run_dir(run_dir: Path, args: GRPOConfig) -> Path:
    """Take the run folder for this run alone, just before anything is written: a timestamped
    default gets a suffix if another run took it meanwhile; an output_dir another run has begun
    writing in since this one was set up is refused; with overwrite_output_dir, a previous run's
    outputs are cleared (other files are left)."""
    if args.output_dir is None:
        stamp, n = run_dir, 1
        while True:
            try:
                run_dir.mkdir(parents=True)
                return run_dir
            except FileExistsError:
                n += 1
                run_dir = stamp.with_name(f"{stamp.name}-{n}")
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.overwrite_output_dir:
        for pattern in RUN_OUTPUTS:
            for path in run_dir.glob(pattern):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    try:
        (run_dir / "config.yaml").open("x").close()  # atomically: one run only gets past here
    except FileExistsError:
        raise ConfigError(f"output_dir {run_dir} was taken by another run after this one was set up; "
                          "choose a new output_dir") from None
    return run_dir
