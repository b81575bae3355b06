"""What a run writes to its folder besides checkpoints: the folder claimed with the run's config, the
final model (whole or not at all), summary.json and the model card."""

from __future__ import annotations

from pathlib import Path

import yaml

from covey.config import RESUME_FIELDS
from covey.errors import CheckpointError
from covey.models import is_peft_model, tokenizer_as_loaded
from covey.telemetry.runlog import latest_run_config, write_json
from covey.telemetry.tables import accuracy_change, model_card
from covey.train.assemble import Assembled
from covey.train.checkpoint import written_whole
from covey.train.run_checkpoints import checkpoint_every_process, whole_model_state
from covey.train.reward_probing import write_probe_findings
from covey.train.run_folder import claim_run_dir, write_run_config
from covey.train.run_state import RunState
from covey.vision.models import save_processor

# hyperparameters the model card lists, as the run used them
MODEL_CARD_FIELDS = ("loss_type", "learning_rate", "num_generations", "max_completion_length", "beta", "epsilon",
                     "epsilon_high", "scale_rewards", "temperature", "num_iterations", "use_peft", "seed")


def open_run_dir(run: Assembled, step: int) -> Path:
    """The run folder, taken for this run (or reopened to resume it at ``step``), with the run's config saved."""
    if run.resume_from is None:
        run_dir = claim_run_dir(run.run_dir, run.args)
    else:
        run_dir = run.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
    save_config(run_dir, run.config_as_used, run.resume_from is not None, step)
    write_probe_findings(run_dir, run.reward_probes)
    return run_dir


def save_config(run_dir: Path, config: dict, resumed: bool, step: int) -> None:
    """config.yaml of the run (the config as used); a resume whose settings differ from the last saved
    ones writes config.resumed-at-<step>.yaml beside them."""
    path = run_dir / "config.yaml"
    if path.exists() and resumed:
        saved = yaml.safe_load(latest_run_config(run_dir).read_text()) or {}
        if ({k: v for k, v in saved.items() if k not in RESUME_FIELDS}
                == {k: v for k, v in config.items() if k not in RESUME_FIELDS}):
            return
        path = run_dir / f"config.resumed-at-{step}.yaml"
    write_run_config(path, config)


def save_final_model(run: Assembled, state: RunState) -> Path:
    """final_model/, whole or not at all (written beside it, then renamed into place). When it cannot
    be written (a full disk), a checkpoint is tried, so that the trained weights are not lost."""
    final = run.run_dir / "final_model"
    try:
        return write_model(run, final)
    except Exception as e:  # OSError, or safetensors' own error type for a full disk (in every process)
        try:
            saved = checkpoint_every_process(run, state)
            kept = (f"the trained weights are in {saved / 'model'}" if run.args.save_only_model else
                    f"the trained weights are in {saved}; free space, then finish the run with --output-dir "
                    f"{run.run_dir} --resume-from-checkpoint auto")
        except CheckpointError:
            kept = "a checkpoint could not be written either"
        raise CheckpointError(f"could not write the final model to {final}: {getattr(e, 'strerror', None) or e} "
                              f"({type(e).__name__}); {kept}") from e


def write_model(run: Assembled, folder: Path) -> Path:
    """The model and its tokenizer (as loaded) in ``folder``, whole or not at all, by the first process
    (a sharded model gathered there first, with every process's help)."""
    whole = whole_model_state(run)
    sampler = run.parts.sampler

    def write() -> Path:
        with written_whole(folder, f"{folder.name}-*") as tmp:
            run.parts.policy.model.save_pretrained(tmp, safe_serialization=True, state_dict=whole)
            save_processor(sampler.processor, tmp)  # a vision-language model's, before its tokenizer
            with tokenizer_as_loaded(sampler.tokenizer) as tokenizer:
                tokenizer.save_pretrained(tmp)
        return folder

    return run.world.on_main(write)


def write_summary(run: Assembled, state: RunState, final: Path, after: dict | None) -> dict:
    """summary.json in the run folder and the model card beside the final model; the summary."""
    before, history = state.before, state.history
    summary = {
        "steps": state.global_step,
        "model": run.model_name,
        "dataset": run.dataset_name,
        "processes": run.world.size,
        "prompts_over_max_prompt_length": run.prompt_overflow_count,
        "final_model": str(final),
        "before": _without_samples(before),
        "after": _without_samples(after),
        "final_metrics": history[-1] if history else None,
    }
    if before and after:
        summary["accuracy_change"] = accuracy_change(before, after)
        summary["eval_samples"] = {"before": before["samples"][:8], "after": after["samples"][:8]}
    write_json(run.run_dir / "summary.json", summary)
    model = run.parts.policy.model
    adapter = is_peft_model(model)
    hyperparameters = {k: run.config_as_used[k] for k in MODEL_CARD_FIELDS}  # as the run used them
    hyperparameters["use_peft"] = adapter
    base = run.model_name
    if adapter:  # the adapter's own settings (those of a saved adapter trained further too)
        lora = model.peft_config[model.active_adapter]
        targets = lora.target_modules
        hyperparameters.update(lora_r=lora.r, lora_alpha=lora.lora_alpha, lora_target_modules=sorted(targets)
                               if isinstance(targets, (set, list)) else targets)
        if (Path(base) / "adapter_config.json").is_file():  # training went on from a saved adapter
            base = lora.base_model_name_or_path or base
    rewards = run.parts.rewards
    (final / "README.md").write_text(model_card(base, run.dataset_name, rewards.names, rewards.weights,
                                                hyperparameters, state.global_step, before, after, adapter=adapter))
    return summary


def _without_samples(result: dict | None) -> dict | None:
    return None if result is None else {k: v for k, v in result.items() if k != "samples"}
