"""The prompts' lengths in tokens, measured before any model loads, for the estimate to take in place of
max_prompt_length.

The data is read where that is cheap and needs no network: a built-in task, a local JSONL/JSON/CSV/Parquet
file, rows handed to the trainer (a list or a ``datasets.Dataset``), or a Hugging Face dataset whose files
are in the hub cache already (nothing is downloaded). At most ``SAMPLE_ROWS`` rows are drawn (seeded), each
prompt rendered as the trainer renders it (``covey.data.text.encode_prompts``: the chat template, the run's
chat_template_kwargs and system_prompt) by the model's tokenizer, loaded without the weights. Where any of
that fails, or the prompts show tools or come from an environment (known only once the run builds them),
the plan takes every prompt at max_prompt_length and says why.

    >>> measure_prompts(GRPOConfig(dataset="arithmetic")).describe()      # doctest: +SKIP
    'prompts measured from arithmetic: longest 61, median 58 tokens'
"""

from __future__ import annotations

import random
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from covey.config import GRPOConfig
from covey.data import is_stream, load_rows
from covey.data.rows import local_format
from covey.data.tasks import TASKS
from covey.data.text import encode_prompts
from covey.models import EMBEDDED_GGUF, load_processing, quiet_transformers
from covey.plan.shapes import embedded_source

SPLIT_WORDS = frozenset({"train", "test", "validation", "valid", "dev", "eval"})  # how hub files name their split
SAMPLE_ROWS = 2000  # rows measured at most: enough for the longest to be near the data's, a second or two to encode


class Unreadable(Exception):
    """The prompts cannot be read before the model loads; the message says why."""


@dataclass(frozen=True)
class PromptLengths:
    """The prompts' lengths in tokens as the estimate takes them: measured (``longest`` set), or every
    prompt at ``limit`` (max_prompt_length) with ``why_not``."""

    limit: int  # max_prompt_length: measured lengths are cut to it, as the trainer cuts or drops longer prompts
    source: str = ""  # the data measured: a task name, a file, "train_dataset", a hub id
    longest: int | None = None  # None: not measured
    median: int | None = None
    rows: int = 0  # rows measured
    of_rows: int = 0  # rows in the data
    over: int = 0  # measured prompts longer than the limit
    why_not: str = ""

    @property
    def measured(self) -> bool:
        return self.longest is not None

    @property
    def peak_length(self) -> int:
        """The length the estimate takes for every prompt: the longest measured, else the limit."""
        return self.longest if self.longest is not None else self.limit

    def describe(self) -> str:
        if not self.measured:
            return (f"prompts: assumed max_prompt_length {self.limit}: the data could not be read before loading "
                    f"({self.why_not})")
        sampled = f", {self.rows:,} of {self.of_rows:,} rows sampled" if self.rows < self.of_rows else ""
        over = f", {self.over:,} over max_prompt_length {self.limit} taken at it" if self.over else ""
        return (f"prompts measured from {self.source}{sampled}: longest {self.longest}, median {self.median} "
                f"tokens{over}")


def measure_prompts(args: GRPOConfig, train_dataset: Any = None, tools: bool = False,
                    sample: int = SAMPLE_ROWS) -> PromptLengths:
    """The lengths of the prompts a run with ``args`` trains on (``train_dataset``: the rows handed to the
    trainer, else ``args.dataset``; ``tools``: the run has tools handed to the trainer, beside ``args.tools``), at
    most ``sample`` of them."""
    try:
        source, rows, of_rows = sampled_rows(args, train_dataset, tools, sample)
        tokenizer, processor = tokenizer_without_weights(args)
        ids = encode_prompts(tokenizer, [row["prompt"] for row in rows], 10**9, source,
                             template_kwargs=args.chat_template_kwargs, processor=processor)
    except Unreadable as e:
        return PromptLengths(args.max_prompt_length, why_not=str(e))
    except Exception as e:  # the data or tokenizer as the trainer would fail on them: its own loading says how
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return PromptLengths(args.max_prompt_length, why_not=first)
    lengths = [len(row) for row in ids]
    cut = sorted(min(n, args.max_prompt_length) for n in lengths)
    return PromptLengths(args.max_prompt_length, source, cut[-1], round(statistics.median(cut)), len(rows), of_rows,
                         sum(n > args.max_prompt_length for n in lengths))


def sampled_rows(args: GRPOConfig, train_dataset: Any, tools: bool, sample: int) -> tuple[str, list[dict], int]:
    """(where the rows come from, at most ``sample`` of the run's training rows drawn with a fixed seed, as
    ``load_rows`` makes them, how many rows the data has)."""
    if tools or args.tools or args.environment_factory:
        raise Unreadable("the prompts show the run's tools, which are read once it starts")
    if is_stream(train_dataset):
        raise Unreadable("train_dataset is a stream, read only as the run goes")
    if train_dataset is not None:
        return "train_dataset", *_drawn(train_dataset, sample, args)
    if "dataset" not in args.fields_given:
        raise Unreadable("no dataset given")
    name = args.dataset
    if name in TASKS:
        return name, *_drawn(load_rows(name, system_prompt=args.system_prompt), sample, None)
    if local_format(name) is not None:
        if not Path(name).is_file():
            raise Unreadable(f"there is no file {name}")
        return name, *_drawn(_arrow_rows(local_format(name), [name]), sample, args)
    files = hub_cached_files(name, args.dataset_config, args.dataset_split)
    if not files:
        raise Unreadable(f"dataset {name!r} is not in the Hugging Face hub cache, and the plan downloads nothing")
    return name, *_drawn(_arrow_rows(local_format(files[0].name), [str(f) for f in files]), sample, args)


def _drawn(rows: Any, sample: int, args: GRPOConfig | None) -> tuple[list[dict], int]:
    """At most ``sample`` of ``rows`` (a list or a ``datasets.Dataset``), drawn with a fixed seed; with
    ``args``, made into training rows as the trainer makes them (GSM8K format, system_prompt)."""
    count = len(rows)
    chosen = sorted(random.Random(0).sample(range(count), sample)) if count > sample else range(count)
    drawn = [dict(rows[i]) for i in chosen]
    return (drawn if args is None else load_rows(drawn, system_prompt=args.system_prompt)), count


def _arrow_rows(loader: str, files: list[str]) -> Any:
    """The rows of local files as a ``datasets.Dataset`` (read into datasets' cache, where the trainer's own
    loading finds them again; no row turned into Python here)."""
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_dataset(loader, data_files=files, split="train")


def hub_cached_files(name: str, config: str | None, split: str) -> list[Path]:
    """The data files of split ``split`` (of configuration ``config``) of the hub dataset ``name`` in the
    Hugging Face hub cache, read from its folder without the network; [] where there are none. Files are
    told apart as the hub names them: a configuration's in a folder of its name, a split's by its name in
    the path (train-00000-of-00001.parquet, data/train.jsonl); a dataset whose files name no split is all
    train."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}"
    ref = folder / "refs" / "main"
    if not ref.is_file():
        return []
    snapshot = folder / "snapshots" / ref.read_text().strip()
    files = sorted(p for p in snapshot.rglob("*") if p.is_file() and local_format(p.name) is not None)
    if config is not None:
        files = [p for p in files if config in p.relative_to(snapshot).parts[:-1]]
    words = {p: set(re.split(r"[/\\_.\-]", str(p.relative_to(snapshot)).lower())) for p in files}
    of_split = [p for p in files if split.lower() in words[p]]
    if not of_split and (split != "train" or any(SPLIT_WORDS & named for named in words.values())):
        return []  # the split asked for is not there, or the files name other splits only
    files = of_split or files
    return files if len({local_format(p.name) for p in files}) == 1 else []


def tokenizer_without_weights(args: GRPOConfig) -> tuple[Any, Any]:
    """(tokenizer, processor or None) of the run's model, its weights not loaded: the embedded model's from
    its converted folder or its GGUF file's header (converting it would load the weights), another's as the
    trainer loads it."""
    if args.model in EMBEDDED_GGUF:
        from transformers import AutoTokenizer

        quiet_transformers()
        folder, gguf_file = embedded_source(args.model)
        return AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf_file} if gguf_file else {})), None
    return load_processing(args.model, args.trust_remote_code, args.model_revision)
