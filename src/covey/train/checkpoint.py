"""Checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is a folder ``RUN_DIR/checkpoints/checkpoint-<step>/`` holding

    model/                  the policy (Hugging Face folder, or the LoRA adapter), safetensors
    optimizer.safetensors   AdamW's tensors; optimizer.json the rest of its state
    reference.safetensors   the reference model, only when sync_ref_model moves it
    rng.safetensors         the torch RNG states; state.json the python / numpy RNG states, the
                            scheduler, the data position, the step counters and the metric history
    rng-<n>.safetensors     the RNG states of process n (with rng-<n>.json) of a run of several

Under ``fsdp`` the model, the optimizer and a moving reference are in ``sharded/`` instead, in the
format of ``torch.distributed.checkpoint``: each process wrote its own shards, and any number of
processes, sharded or not, reads them back (its metadata file is that library's own, a pickle).

Under ``save_only_model`` a checkpoint holds ``model/`` and a ``state.json`` that says so, and
nothing else: no run resumes from it (it lacks what would make the continuation exact), but its
``model/`` loads as any model folder.

It is written into a hidden temporary folder, flushed to disk, then renamed into place, so a crash
or a full disk never leaves a half-written ``checkpoint-<step>`` behind and never harms the
previous one. Apart from that metadata, no file is a pickle.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

from covey.data.sampler import python_random_state
from covey.errors import CheckpointError, ConfigError
from covey.models import is_peft_model
from covey.train.distributed import sharded_part
from covey.train.forward import TrainingForward
from covey.vision.models import save_processor

CHECKPOINTS = "checkpoints"
PREFIX = "checkpoint-"
MODEL_ONLY = "model_only"  # the state.json key of a checkpoint written under save_only_model
SHARDED = "sharded"  # the folder of a sharded run's model, optimizer and reference (torch.distributed.checkpoint)


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()
             and (p / "state.json").is_file()]
    return sorted(found, key=step_of)


def step_of(checkpoint: Path) -> int:
    """The optimizer step a checkpoint folder was written at, from its name."""
    return int(checkpoint.name[len(PREFIX):])


def saved_step(checkpoint: Path) -> int:
    """The optimizer step a checkpoint folder was written at, from its state (whatever the folder's name)."""
    return int(json.loads((checkpoint / "state.json").read_text())["step"])


def resolve_checkpoint(spec: str, output_dir: str | None) -> Path:
    """The checkpoint folder named by ``resume_from_checkpoint``: 'auto' or a path."""
    if spec == "auto":
        if output_dir is None:
            raise ConfigError("resume_from_checkpoint: auto needs output_dir, the run folder to continue")
        found = checkpoint_dirs(Path(output_dir))
        if not found:
            raise ConfigError(f"resume_from_checkpoint: auto found no checkpoint in {Path(output_dir) / CHECKPOINTS}; "
                              "was save_strategy no (or save_steps 0), or did the run stop before its first save?")
        path = found[-1].resolve()
    else:
        path = Path(spec).resolve()
    if not (path / "state.json").is_file():
        raise ConfigError(f"resume_from_checkpoint: {path} is not a checkpoint folder (it has no state.json); "
                          f"give a {CHECKPOINTS}/{PREFIX}<step> folder of a run, or 'auto'")
    if json.loads((path / "state.json").read_text()).get(MODEL_ONLY):
        raise ConfigError(f"resume_from_checkpoint: {path} was written under save_only_model: true and holds the "
                          "model alone, without the optimizer, scheduler and random states a run continues from, so "
                          f"the run cannot resume from it. Start a new run from its weights (model: {path / 'model'}), "
                          "or resume from a checkpoint written without save_only_model")
    return path


# ---- writing ---------------------------------------------------------------------------------


IN_FLIGHT = "in_flight.pt"  # async_generation: the rounds sampled ahead when the checkpoint was written


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer_state: dict[str, Any] | None,
                    state: dict[str, Any], reference: torch.nn.Module | None = None,
                    total_limit: int | None = None, tokenizer: Any = None, other_processes_rng: list = (),
                    sharded: Path | None = None, model_state: dict | None = None, whole_model: bool = False,
                    in_flight: list | None = None, processor: Any = None) -> Path:
    """Write checkpoint-<step> atomically and keep only the newest ``total_limit``; its path.
    ``optimizer_state``: the optimizer's ``state_dict()`` (whole, where it is sharded over processes),
    or None for a checkpoint of the model alone (save_only_model: ``state`` and the reference are then
    left out too); ``state`` is the trainer's JSON-able state (counters, data position, scheduler,
    metric history); ``tokenizer``, saved beside the model, makes its folder a model that loads on its
    own; ``other_processes_rng``: ``rng_states()`` of processes 1, 2, ... of a run of several;
    ``sharded``: the folder ``save_sharded`` wrote (the model, optimizer and reference of a sharded run),
    moved in as ``sharded/``, with ``model/`` beside it only if ``whole_model``; ``model_state``: the whole
    state dict of a sharded model, for ``model/``; ``in_flight``: under async_generation, the rounds
    each process sampled ahead and had not trained yet (``in_flight.pt``, in process order), which a
    resumed run trains next; ``processor``: a vision-language model's, saved beside the model with its tokenizer."""
    folder = Path(run_dir) / CHECKPOINTS
    final = folder / f"{PREFIX}{step}"
    try:
        with written_whole(final, f"{PREFIX}*") as tmp:
            if sharded is not None:
                sharded.rename(tmp / SHARDED)
                _write_rng_and_state(tmp, step, state, other_processes_rng)
                if whole_model:  # beside the shards, as a model that loads on its own
                    model.save_pretrained(tmp / "model", safe_serialization=True, state_dict=model_state)
            else:
                model.save_pretrained(tmp / "model", safe_serialization=True, state_dict=model_state)
                save_processor(processor, tmp / "model")  # before its tokenizer, as the final model's
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp / "model")
                if optimizer_state is None:
                    _write_json(tmp / "state.json", {"step": step, MODEL_ONLY: True})
                else:
                    _write_training_state(tmp, step, optimizer_state, state, reference, other_processes_rng)
                    if in_flight is not None:
                        torch.save(in_flight, tmp / IN_FLIGHT)
    except Exception as e:  # OSError, or safetensors' own error type for the same disk and permission faults
        previous = [p.name for p in checkpoint_dirs(run_dir)]
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(f"could not write the checkpoint of step {step} to {final}: "
                              f"{getattr(e, 'strerror', None) or e} ({type(e).__name__}); {kept}. Free disk space or "
                              "fix the folder's permissions, then resume with --resume-from-checkpoint auto") from e
    if total_limit is not None:
        others = [p for p in checkpoint_dirs(run_dir) if p != final]  # the one just written always stays
        for older in others[: max(0, len(others) + 1 - total_limit)]:
            shutil.rmtree(older, ignore_errors=True)
    return final


def sharded_staging(run_dir: Path, step: int) -> Path:
    """The empty folder that every process of a sharded run writes its shards of checkpoint-<step> into
    (``save_sharded``), before the first process moves it into the checkpoint; leftovers cleared."""
    folder = Path(run_dir) / CHECKPOINTS
    for stale in folder.glob(f".{SHARDED}-{PREFIX}*"):  # of a writer killed midway
        shutil.rmtree(stale, ignore_errors=True)
    staging = folder / f".{SHARDED}-{PREFIX}{step}"
    staging.mkdir(parents=True)
    return staging


def save_sharded(folder: Path, policy_pass: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 reference_pass: torch.nn.Module | None = None) -> None:
    """The sharded model, optimizer state and (moving) reference into ``folder``, each process its own
    shards (torch.distributed.checkpoint); every process calls it, together."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_state, optimizer_state = get_state_dict(policy_pass, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if reference_pass is not None:
        state["reference"] = get_model_state_dict(reference_pass)
    dcp.save(state, checkpoint_id=str(folder), no_dist=not torch.distributed.is_initialized())


def _load_sharded(folder: Path, policy_pass: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  reference_pass: torch.nn.Module | None) -> None:
    """``save_sharded``'s folder into a run of any number of processes, sharded or not: each reads the
    parts of the saved shards that its own shards (or whole tensors) cover."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    own_settings = [{key: group.get(key) for key in RUN_OPTIMIZER_SETTINGS} for group in optimizer.param_groups]
    model_state, optimizer_state = get_state_dict(policy_pass, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    if reference_pass is not None and not any(key.startswith("reference.") for key in saved):
        reference_pass = None  # written while the reference did not move
    if reference_pass is not None:
        state["reference"] = get_model_state_dict(reference_pass)
    dcp.load(state, checkpoint_id=str(folder), no_dist=not torch.distributed.is_initialized())
    set_state_dict(policy_pass, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if reference_pass is not None:
        set_model_state_dict(reference_pass, state["reference"])
    for group, settings in zip(optimizer.param_groups, own_settings):  # as in a plain resume
        group.update(settings)


def _write_training_state(folder: Path, step: int, optimizer_state: dict[str, Any], state: dict[str, Any],
                          reference: torch.nn.Module | None, other_processes_rng: list) -> None:
    """Everything of a checkpoint beside the model: optimizer, reference, random states, trainer state."""
    tensors, rest = _split_optimizer_state(optimizer_state)
    save_file(tensors, folder / "optimizer.safetensors")
    _write_json(folder / "optimizer.json", rest)
    if reference is not None:
        save_model(reference, str(folder / "reference.safetensors"))
    _write_rng_and_state(folder, step, state, other_processes_rng)


def _write_rng_and_state(folder: Path, step: int, state: dict[str, Any], other_processes_rng: list) -> None:
    torch_states, other_states = rng_states()
    save_file(torch_states, folder / "rng.safetensors")
    _write_json(folder / "state.json", {**state, "step": step, "rng": other_states})
    for process, (torch_states, other_states) in enumerate(other_processes_rng, start=1):
        save_file(torch_states, folder / f"rng-{process}.safetensors")
        _write_json(folder / f"rng-{process}.json", other_states)


@contextlib.contextmanager
def written_whole(final: Path, kind: str) -> Iterator[Path]:
    """A folder written in full or not at all. Yields a hidden empty folder beside ``final`` to write
    into; when the block succeeds it is flushed to disk and renamed to ``final``. A ``final`` already
    there (the same step saved again) is moved aside until the new one is in place, so that a crash
    at any moment leaves one of the two whole. On an error the partial folder is deleted and ``final``
    stays as it was. ``kind``: a glob of the names whose leftovers (of a writer killed midway) are
    cleared first, or put back where they are the only copy."""
    parent = final.parent
    tmp, old = parent / f".tmp-{final.name}-{os.getpid()}", parent / f".old-{final.name}-{os.getpid()}"
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f".tmp-{kind}"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in parent.glob(f".old-{kind}"):
        whole = parent / stale.name[len(".old-"):].rsplit("-", 1)[0]
        if whole.exists():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.rename(whole)
    try:
        tmp.mkdir()
        yield tmp
        _modes_as_umask_gives(tmp)
        _fsync_tree(tmp)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            old.rename(final)
        raise
    shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(OSError):  # the new folder is in place: a failed flush of its name is no failed write
        _fsync_dir(parent)


def _split_optimizer_state(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors of the optimizer state (for safetensors) and everything else (for JSON)."""
    tensors, rest = {}, {"param_groups": state_dict["param_groups"], "state": {}}
    for index, param_state in state_dict["state"].items():
        rest["state"][str(index)] = {}
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach().contiguous()
            else:
                rest["state"][str(index)][key] = value
    return tensors, rest


def rng_states() -> tuple[dict[str, torch.Tensor], dict]:
    """This process's torch (and CUDA) RNG states, and its python and numpy ones (JSON-able)."""
    import numpy as np

    torch_states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            torch_states[f"cuda.{i}"] = s
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return torch_states, {"python": random.getstate(),  # JSON writes its tuples as lists
                          "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def _write_json(path: Path, value: Any) -> None:
    """``value`` as JSON, written as it is encoded: a long run's state (its metric history) is never made
    whole as one string, a block that memory freed between checkpoints, cut by what was kept since,
    could not hold (each checkpoint then grew the process by the state's size)."""
    with path.open("w") as f:
        json.dump(value, f)


def _modes_as_umask_gives(root: Path) -> None:
    """Give the safetensors files under ``root`` the mode an ordinary new file gets (0o666 less the
    umask): safetensors writes them 0o600, unreadable to the other users a model is shared with."""
    mask = _umask()
    for path in root.rglob("*.safetensors"):
        if path.is_file():
            path.chmod(0o666 & ~mask)


def _umask() -> int:
    """The process's umask, read without setting it where the system says it (Linux)."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/self/status") as status:
            return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o077)  # elsewhere: set and put back at once, the strictest value meanwhile
    os.umask(mask)
    return mask


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        else:
            _fsync_dir(path)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- reading ---------------------------------------------------------------------------------


# optimizer settings a resumed run takes from its own config rather than from the checkpoint
RUN_OPTIMIZER_SETTINGS = ("betas", "eps", "weight_decay", "fused", "foreach")


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    reference: torch.nn.Module | None = None, process: int = 0,
                    policy_pass: torch.nn.Module | None = None, reference_pass: torch.nn.Module | None = None
                    ) -> dict[str, Any]:
    """Restore the model, optimizer, reference and every RNG from ``path``; the trainer's state.
    ``process``: the RNGs are that process's where the checkpoint has them (else the first one's).
    ``policy_pass``, ``reference_pass``: a sharded run's passes around the policy and the reference."""
    if (path / SHARDED).is_dir():
        _load_sharded(path / SHARDED, policy_pass or TrainingForward(model), optimizer,
                      None if reference is None else reference_pass or TrainingForward(reference))
    elif policy_pass is not None:
        raise CheckpointError(f"{path} was written by a run without fsdp, and this run shards the model (fsdp); "
                              "resume it without fsdp (at any number of processes), or start the sharded run from "
                              f"its weights (model: {path / 'model'})")
    else:
        _load_whole(path, model, optimizer, reference)
    trainer_state = json.loads((path / "state.json").read_text())
    first_process_rng = trainer_state.pop("rng")
    if process and (path / f"rng-{process}.safetensors").is_file():
        _restore_rng(load_file(path / f"rng-{process}.safetensors"), json.loads((path / f"rng-{process}.json").read_text()))
    else:
        _restore_rng(load_file(path / "rng.safetensors"), first_process_rng)
        if process:  # written by fewer processes: streams of its own, drawn from the first process's
            _seed_all(int(torch.randint(2 ** 62, (1,))) + process)
    return trainer_state


def _load_whole(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                reference: torch.nn.Module | None) -> None:
    """The model, optimizer and reference of a checkpoint that holds them whole."""
    _load_model(path / "model", model)
    share = sharded_part(optimizer)
    # a process that holds a part of the optimizer state reads that part only: reading the whole file in
    # each process would hold every process's state in each, at once
    held = None if share is None else _indices_held(optimizer, share)
    tensors = _read_tensors(path / "optimizer.safetensors", lambda index: held is None or index in held)
    rest = json.loads((path / "optimizer.json").read_text())
    state = {}
    for index, plain in rest["state"].items():
        if held is None or int(index) in held:
            state[int(index)] = dict(plain)
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    # the update's settings (betas, eps, weight decay) are this run's config, as is which kernel runs it
    # (by device): given before loading, so that the state is placed for that kernel (the fused one keeps
    # its step counts on the device)
    groups = [{**saved, **{key: group.get(key) for key in RUN_OPTIMIZER_SETTINGS}}
              for saved, group in zip(rest["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    if share is not None:
        optimizer.state.clear()  # a copy of the whole state beside the parts, which the update never reads
        # its part as a plain optimizer loads it: the moments in the parameter's dtype, and the fused
        # kernel's step counts beside the parameters (torch's sharded loader leaves them on the CPU)
        for param, param_state in share.state.items():
            for key, value in param_state.items():
                if key == "step" and share.defaults.get("fused"):
                    param_state[key] = value.to(param.device, torch.float32)
                elif key != "step" and value.is_floating_point() and param.is_floating_point():
                    param_state[key] = value.to(param.dtype)
    if reference is not None and (path / "reference.safetensors").is_file():
        load_model(reference, str(path / "reference.safetensors"))


def _indices_held(optimizer: torch.optim.Optimizer, share: torch.optim.Optimizer) -> set[int]:
    """The indices (in the whole optimizer's state_dict) of the parameters whose state ``share`` holds."""
    mine = {id(p) for group in share.param_groups for p in group["params"]}
    return {i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"]) if id(p) in mine}


def _read_tensors(file: Path, wanted: Callable[[int], bool]) -> dict[str, torch.Tensor]:
    """The optimizer tensors (named ``<index>.<name>``) of ``file`` whose parameter index is ``wanted``,
    read one by one: the others are never read."""
    with safe_open(str(file), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys() if wanted(int(key.split(".", 1)[0]))}


def _load_model(folder: Path, model: torch.nn.Module) -> None:
    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
        if missing:
            raise CheckpointError(f"{folder}: the adapter lacks {len(missing)} LoRA weights (first: {missing[0]}); "
                                  "was it saved with different lora_r / lora_target_modules?")
        return
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(shard))
    missing, unexpected = model.load_state_dict(state, strict=False)
    loaded = {t.data_ptr() for name, t in model.state_dict().items() if name in state}
    untied = [k for k in missing if model.state_dict()[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise CheckpointError(f"{folder} does not match the model of this run (missing {untied[:3]}, unexpected "
                              f"{unexpected[:3]}); resume with the same model as the run that saved it")


def _seed_all(seed: int) -> None:
    import numpy as np

    torch.manual_seed(seed)  # and every CUDA device
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)


def _restore_rng(torch_states: dict[str, torch.Tensor], other: dict) -> None:
    import numpy as np

    torch.set_rng_state(torch_states["torch"])
    cuda = [torch_states[f"cuda.{i}"] for i in range(sum(k.startswith("cuda.") for k in torch_states))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python_random_state(other["python"]))
    kind, keys, pos, has_gauss, cached = other["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
