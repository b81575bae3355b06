"""``covey plan --probe``: train a real step or two of the run (in a scratch folder) and time them."""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback

from covey.plan.report import gib
from covey.train.trainer import GRPOTrainer


@dataclass(frozen=True)
class Probe:
    step_seconds: float  # the last probed step's wall time (the first warms up)
    steps: int  # optimizer steps of the whole run
    peak_bytes: int  # measured: the GPU's max_memory_allocated, or the process's RSS high-water on a CPU
    measured_on: str

    @property
    def run_seconds(self) -> float:
        return self.step_seconds * self.steps


def reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # the RSS high-water mark from here on (Linux)
        except OSError:
            pass


def measured_peak() -> tuple[int, str]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"
    try:
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024, "the process's RSS high-water mark"
    except (OSError, StopIteration):
        return 0, "nothing (no /proc here)"


class StopAfter(TrainerCallback):
    """Ends a run after ``steps`` optimizer steps, as a user's callback would (its schedule still the whole run's)."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, args, state, control, **_):
        if state.global_step >= self.steps:
            control.should_training_stop = True


def probe(args) -> Probe:
    """Two steps of the run (one if it has one), with nothing written where the run would write: no
    evaluation, checkpoint or completion log, in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="covey-probe-") as scratch:
        settings = dataclasses.replace(
            args, output_dir=str(Path(scratch) / "run"), overwrite_output_dir=False, resume_from_checkpoint=None,
            eval_max_samples=0, eval_strategy="no", save_strategy="no", log_completions=False, report_to=["none"],
            push_to_hub=False, memory_check=False, logging_steps=1)  # the last step logged on its own
        trainer = GRPOTrainer(args=settings, quiet=True)
        steps = trainer.args.max_steps  # the whole run's (max_steps: -1 resolved from the epochs)
        trainer.add_callback(StopAfter(min(2, steps)))
        reset_peak()
        trainer.train()
        peak, how = measured_peak()
        return Probe(float(trainer.history[-1]["step_time"]), steps, peak, how)


def probe_text(plan, result: Probe) -> str:
    minutes = result.run_seconds / 60
    return "\n".join([
        f"probe: a step took {result.step_seconds:.1f} s; {result.steps} steps: about "
        + (f"{minutes / 60:.1f} h" if minutes >= 90 else f"{minutes:.1f} min")
        + " of training (evaluations and checkpoints not counted)",
        f"probe: measured peak {gib(result.peak_bytes)} ({result.measured_on}) against the estimate "
        f"{gib(plan.needed)}"])
