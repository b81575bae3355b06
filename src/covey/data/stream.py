"""Training rows read from a stream as the rounds ask for them: a ``datasets.IterableDataset`` (a dataset
loaded with ``streaming=True``), or any iterable of rows that is not a list or a ``datasets.Dataset``.

The rows are taken in the stream's order (shuffle it first, ``dataset.shuffle(buffer_size=...)``, as with
TRL), a round's prompts at a time, and only the rows of the last few rounds are held: a stream longer
than memory trains. Row ``i`` is the ``i``-th row the stream gave that was kept (a prompt over
max_prompt_length that ``prompt_overflow: drop`` leaves out is not counted), so a checkpoint's position
is a number, and a resumed run reads on from the same row. A stream that ends before the run does is
read again from its start (a new pass) where it can be (an ``IterableDataset`` can; a generator cannot).
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, Callable, Iterable, Iterator

from covey.errors import DataError

# rows read and prepared at once (their chat templates rendered and tokenized together)
CHUNK_ROWS = 64


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is read as a stream: a ``datasets.IterableDataset``, or an iterable of rows
    without a length (a generator, an iterator). Lists, ``datasets.Dataset`` and names are loaded whole."""
    if dataset is None or isinstance(dataset, (str, bytes, dict, list, tuple)):
        return False
    try:
        import datasets

        if isinstance(dataset, datasets.IterableDataset):
            return True
        if isinstance(dataset, (datasets.Dataset, datasets.DatasetDict, datasets.IterableDatasetDict)):
            return False
    except ImportError:
        pass
    return isinstance(dataset, Iterable) and not hasattr(dataset, "__len__")


def first_rows(dataset: Any, count: int) -> tuple[list[dict], Any]:
    """The first ``count`` rows of a stream, to check before training, and the stream to train on: the
    same object where it can be read again from its start, else the rows read chained before the rest."""
    if iter(dataset) is not dataset:  # read again from the start by iterating it anew
        return [dict(row) for row in itertools.islice(iter(dataset), count)], dataset
    head = [dict(row) for row in itertools.islice(dataset, count)]
    return head, _Once(itertools.chain(head, dataset))


class _Once:
    """An iterator handed over as a stream: read once, from where it stands."""

    def __init__(self, rows: Iterator[dict]):
        self.rows = rows

    def __iter__(self) -> Iterator[dict]:
        return self.rows


class RowStream:
    """The stream's rows by position, read forward as they are asked for and prepared by ``prepare`` (raw
    rows -> the rows kept and their prompts' token ids), holding the last ``window`` positions asked for."""

    def __init__(self, source: Any, prepare: Callable[[list[dict]], tuple[list[dict], list[list[int]]]],
                 window: int, name: str = "the training stream"):
        self.source, self.prepare, self.window, self.name = source, prepare, window, name
        self.held: dict[int, tuple[dict, list[int]]] = {}
        self.read = 0  # rows kept so far: the next position
        self.passes = 0  # whole passes over the stream
        self.length: int | None = None  # rows kept in one pass, once a pass has ended
        self.rows_iter: Iterator[dict] | None = None
        self.rows, self.ids = _View(self, 0), _View(self, 1)

    def get(self, position: int) -> tuple[dict, list[int]]:
        """The row at ``position`` and its prompt's token ids."""
        while self.read <= position:
            self._read_chunk()
        if position not in self.held:
            raise DataError(f"{self.name}: row {position} was read and let go (only the last {self.window} rows "
                            "asked for are held); a stream is read forward only")
        for old in [p for p in self.held if 0 < p < position - self.window]:  # the first row stays: a stand-in
            del self.held[old]
        return self.held[position]

    def _read_chunk(self) -> None:
        if self.rows_iter is None:
            self.rows_iter = iter(self.source)
        chunk = [dict(row) for row in itertools.islice(self.rows_iter, CHUNK_ROWS)]
        if not chunk:
            self._next_pass()
            return
        for row, ids in zip(*self.prepare(chunk)):
            self.held[self.read] = (row, ids)
            self.read += 1

    def _next_pass(self) -> None:
        if self.read == self.passes_start:
            raise DataError(f"{self.name} gave no row to train on")
        if iter(self.source) is self.source or isinstance(self.source, _Once):
            raise DataError(f"{self.name} ended after {self.read} rows, and an iterator cannot be read again: give "
                            "max_steps the stream lasts for, or a dataset that can be iterated again "
                            "(datasets.IterableDataset)")
        self.length = self.read - self.passes_start
        self.passes += 1
        self.rows_iter = iter(self.source)

    @property
    def passes_start(self) -> int:
        """The position of the current pass's first row."""
        return 0 if self.length is None else self.passes * self.length


class _View:
    """``Prompts.rows`` or ``Prompts.ids`` of a stream: indexed by position."""

    def __init__(self, stream: RowStream, part: int):
        self.stream, self.part = stream, part

    def __getitem__(self, position: int | slice) -> Any:
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        return self.stream.get(position)[self.part]

    def __len__(self) -> int:
        """The rows read so far (a stream's length is not known before it ends)."""
        return self.stream.read

    def __iter__(self) -> Iterator[Any]:
        return iter([self.stream.held[p][self.part] for p in sorted(self.stream.held)])


class StreamOrder:
    """The prompt sampler of a stream (``PromptSampler``'s interface): positions in order, a round's at a
    time; its state is the next position."""

    def __init__(self, stream: RowStream, prompts_per_step: int):
        self.stream, self.prompts_per_step, self.position = stream, prompts_per_step, 0

    def __iter__(self) -> StreamOrder:
        return self

    def __next__(self) -> list[int]:
        batch = list(range(self.position, self.position + self.prompts_per_step))
        self.position += self.prompts_per_step
        return batch

    @property
    def progress(self) -> float:
        """Passes over the stream done (whole ones: its length is known only once a pass has ended)."""
        return float(self.stream.passes)

    def passes_in(self, draws: int) -> int:
        length = self.stream.length
        return 0 if length is None else draws * self.prompts_per_step // length

    def passes_begun_in(self, draws: int) -> int:
        """As transformers counts the epochs of data without a length: as many as there may be."""
        length = self.stream.length
        return sys.maxsize if length is None else -(-draws * self.prompts_per_step // length)

    def progress_in(self, draws: int) -> float:
        length = self.stream.length
        return 0.0 if length is None else draws * self.prompts_per_step / length

    def resumes_over(self, num_rows: int) -> bool:
        """Whether a saved position fits the data: a stream's always does (it is read on from there)."""
        return True

    def state_dict(self) -> dict:
        return {"stream_position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if "stream_position" not in state:
            raise DataError("the checkpoint was written by a run over a dataset in memory, and this run streams "
                            "its training rows; resume with the same kind of dataset")
        self.position = state["stream_position"]
