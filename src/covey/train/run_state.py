"""A run's state between its steps, as one value.

What a run is made of and keeps for its whole length (its settings, the step's parts, its folder) is
``covey.train.assemble.Assembled``. What changes from step to step is ``RunState``: where the run
stands (``Progress``), the metrics logged so far and those not logged yet, the held-out evaluation
before training, and the rounds a resumed checkpoint held in flight. ``GRPOTrainer`` holds the
current value and is the only code that replaces it; the step (``covey.train.step``) and the code
between steps (``covey.train.between_steps``, ``covey.train.run_checkpoints``) take a state and
return the next. A stop asked for by a signal is the one thing that arrives from outside the loop:
it is ``between_steps.StopRequest``, which the signal handler sets and the loop reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from covey.config import GRPOConfig
from covey.train.batch import Progress


@dataclass(frozen=True)
class RunState:
    """Where a run stands between two steps: all of it goes into a checkpoint, and a resume starts from it."""

    progress: Progress  # the counters: optimizer steps, rounds drawn, skipped steps, the entropy coefficient
    history: tuple[dict, ...] = ()  # each logged step's metrics, as metrics.jsonl holds them
    unlogged: tuple[dict, ...] = ()  # each optimizer step's metrics since the last logged one (averaged into the next)
    before: dict | None = None  # the held-out evaluation before training (None: none was made)
    in_flight: dict | None = None  # async_generation: the rounds a resumed checkpoint held in flight, trained first

    @classmethod
    def start(cls, args: GRPOConfig) -> RunState:
        """The state of a run that has taken no step."""
        return cls(Progress(entropy_coef=args.entropy_coef))

    @property
    def global_step(self) -> int:
        return self.progress.global_step

    def saved(self) -> dict:
        """What a checkpoint writes of it (the rounds in flight go into a file of their own)."""
        return {**dataclasses.asdict(self.progress), "history": list(self.history), "before": self.before,
                "unlogged_metrics": list(self.unlogged)}

    def restored(self, saved: dict, args: GRPOConfig, in_flight: dict | None) -> RunState:
        """This state taken back to what a checkpoint ``saved``. A counter an older checkpoint lacks keeps its
        start value; a fixed entropy coefficient is this run's config, as the learning rate is."""
        progress = dataclasses.replace(self.progress, **{f.name: saved[f.name] for f in dataclasses.fields(Progress)
                                                         if f.name in saved})
        if not args.use_adaptive_entropy:
            progress = dataclasses.replace(progress, entropy_coef=args.entropy_coef)
        return RunState(progress, tuple(saved["history"]), tuple(saved.get("unlogged_metrics", ())), saved["before"],
                        in_flight)
