"""The order prompts are used in: shuffled passes over the training rows, a fixed number at a time."""

from __future__ import annotations

import random
from typing import Iterator

from covey.errors import DataError


class PromptSampler:
    """Row indices in shuffled passes over the dataset (seeded; ``shuffle`` False: in the dataset's order),
    a fixed number at a time, forever."""

    def __init__(self, num_rows: int, prompts_per_step: int, seed: int, shuffle: bool = True):
        self.num_rows, self.prompts_per_step, self.shuffle = num_rows, prompts_per_step, shuffle
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.epoch = 0

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        batch = []
        while len(batch) < self.prompts_per_step:
            if not self.order:
                self.order = list(range(self.num_rows))
                if self.shuffle:
                    self.rng.shuffle(self.order)
                else:
                    self.order.reverse()  # drawn from the end: row 0 first
                self.epoch += 1
            batch.append(self.order.pop())
        return batch

    @property
    def progress(self) -> float:
        """Passes over the data done, a fraction within the current one (0.0 before the first draw)."""
        return max(self.epoch - 1, 0) + (self.num_rows - len(self.order)) / self.num_rows if self.epoch else 0.0

    def passes_in(self, draws: int) -> int:
        """Whole passes over the data in the first ``draws`` draws (a pass ends with the draw of its last row)."""
        return draws * self.prompts_per_step // self.num_rows

    def passes_begun_in(self, draws: int) -> int:
        """The passes over the data the first ``draws`` draws begin (the last perhaps unfinished)."""
        return -(-draws * self.prompts_per_step // self.num_rows)

    def progress_in(self, draws: int) -> float:
        """Passes over the data in the first ``draws`` draws, a fraction within the last (``progress`` after
        them, reckoned the same way)."""
        drawn = draws * self.prompts_per_step
        if not drawn:
            return 0.0
        shuffles = -(-drawn // self.num_rows)
        left = shuffles * self.num_rows - drawn
        return max(shuffles - 1, 0) + (self.num_rows - left) / self.num_rows

    def resumes_over(self, num_rows: int) -> bool:
        """Whether a saved position fits a dataset of ``num_rows`` rows (every index still to come is in it)."""
        return all(i < num_rows for i in self.order)

    def state_dict(self) -> dict:
        """The position in the data (JSON-able), for checkpoints."""
        return {"rng": self.rng.getstate(), "order": list(self.order), "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        if "order" not in state:
            raise DataError("the checkpoint was written by a run that streamed its training rows, and this run "
                            "holds its dataset in memory; resume with the same kind of dataset")
        self.rng.setstate(python_random_state(state["rng"]))
        self.order, self.epoch = list(state["order"]), state["epoch"]


def python_random_state(saved: list) -> tuple:
    """A ``random.getstate()`` value back from its JSON form (lists where it had tuples)."""
    version, internal, gauss = saved
    return version, tuple(internal), gauss
