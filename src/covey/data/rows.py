"""Datasets: where prompts come from, what a valid row is, and the order they are used in.

A row is a dict with a ``prompt`` (a chat as a list of {"role", "content"} messages, or a plain
string) and any extra columns, which are passed to the reward functions by name.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from covey.data import tasks
from covey.errors import DataError
from covey.sources import why_unloadable
from covey.vision import valid_content, with_images_in_prompts

# what every reward call receives from the trainer beside the dataset's columns, which pass by name: no
# column may be called so (``environments``: the episodes' environment instances, where there are any)
TRAINER_REWARD_ARGS = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra",
                                 "environments"})
# file name endings (in any case) and the loader of each; datasets' loaders read gzip-compressed text files as they are
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet",
                 ".jsonl.gz": "json", ".json.gz": "json", ".csv.gz": "csv"}


# the prompt of a row whose environment writes it (its reset() returns the text), as TRL makes it
EMPTY_PROMPT = [{"role": "user", "content": ""}]


def load_rows(spec: Any, split: str = "train", system_prompt: str | None = None, config: str | None = None,
              prompts_from_environment: bool = False) -> list[dict]:
    """Rows from a built-in task name, a local JSONL/JSON/CSV/Parquet file (JSONL, JSON and CSV also
    gzip-compressed, .gz), a Hugging Face dataset id (``config``: its configuration, such as gsm8k's
    main), or an in-memory list / ``datasets.Dataset``. GSM8K-format data (question, answer with '####')
    is turned into chat prompts automatically, keeping its other columns. ``system_prompt``: a system
    message put before every prompt. ``prompts_from_environment``: data without a prompt column is the
    environment's to prompt (each row gets an empty user message, which reset() fills)."""
    if isinstance(spec, str):
        if reason := why_unloadable(spec, "dataset"):
            raise DataError(reason)
        path, file_format = Path(spec), local_format(spec)
        if config is not None and (spec in tasks.TASKS or file_format is not None):
            raise DataError(f"dataset_config={config!r} chooses a configuration of a Hugging Face dataset, and "
                            f"{spec!r} is a {'built-in task' if spec in tasks.TASKS else 'local file'}; remove "
                            "dataset_config")
        if spec in tasks.TASKS:
            rows = tasks.TASKS[spec]("test" if split == "test" else "train")
        elif file_format is not None:
            if not path.is_file():
                raise DataError(f"dataset file {path} does not exist")
            check_text_file(path, file_format)
            rows = _load_with_datasets(file_format, data_files=str(path), split="train")
        else:
            rows = _load_with_datasets(spec, split=split, **({} if config is None else {"name": config}))
        source = spec
        folder = path.parent if file_format is not None else None
    else:
        rows, source, folder = [dict(r) for r in spec], "train_dataset", None
    covey_wrote_prompts = isinstance(spec, str) and spec in tasks.TASKS  # a built-in task's
    if rows and "prompt" not in rows[0] and {"question", "answer"} <= set(rows[0]):
        rows, covey_wrote_prompts = tasks.gsm8k_rows(rows, source), True
    elif rows and "prompt" not in rows[0] and prompts_from_environment:
        rows = [{"prompt": EMPTY_PROMPT, **row} for row in rows]
    rows = with_images_in_prompts(rows, source, folder)  # an image / images column: pictures in the prompts
    check_rows(rows, source)
    if system_prompt is None:
        return rows
    return with_system_prompt(rows, system_prompt, source, replace_system=covey_wrote_prompts)


def with_system_prompt(rows: list[dict], system_prompt: str, source: str, replace_system: bool = False
                       ) -> list[dict]:
    """The rows with ``system_prompt`` as the first message of each prompt (a plain-text prompt becomes
    the user's message). A system message covey wrote (``replace_system``: a built-in task's, GSM8K-format
    data's) gives way to it; one the data has is an error, not overwritten."""
    out = []
    for i, row in enumerate(rows):
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if replace_system and messages and messages[0].get("role") == "system":
            messages = messages[1:]
        elif messages and messages[0].get("role") == "system":
            raise DataError(f"{source}, row {i}: the prompt has a system message already, and system_prompt gives "
                            "another; drop one of the two")
        out.append({**row, "prompt": [{"role": "system", "content": system_prompt}, *messages]})
    return out


def local_format(name: str) -> str | None:
    """The datasets loader for a local file of this name ("json", "csv", "parquet"), by its ending
    in any case (data.JSONL, data.csv.gz); None for a name that is not a local file format."""
    lowered = name.lower()
    return next((loader for ending, loader in LOCAL_FORMATS.items() if lowered.endswith(ending)), None)


def check_text_file(path: Path, file_format: str) -> None:
    """A local JSON or CSV file that is empty, or a JSON Lines row that is not a JSON object, said with
    its line (the datasets loader names neither)."""
    if file_format == "parquet":
        return
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DataError(f"dataset file {path} cannot be read as UTF-8 text{' (gzip)' if opener is gzip.open else ''}: "
                        f"{e}") from None
    if not text.strip():
        raise DataError(f"dataset file {path} is empty: give one row per line (JSON Lines), a JSON list of rows, "
                        "or a CSV file with a header")
    if file_format != "json":
        return
    try:
        json.loads(text)
        return  # one JSON document (a list of rows, or a single row)
    except ValueError:
        pass
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}, line {number}: not valid JSON ({e.msg}, column {e.colno}); each line of a "
                            "JSON Lines file is one JSON object") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}, line {number}: a JSON {type(row).__name__}, not an object; each line of a "
                            "JSON Lines file is one row, such as {\"prompt\": ...}")


def _load_with_datasets(*args: Any, **kwargs: Any) -> list[dict]:
    import datasets

    datasets.disable_progress_bars()  # a local file loads in a blink; a bar per load is noise
    try:
        return [dict(r) for r in datasets.load_dataset(*args, **kwargs)]
    except Exception as e:  # datasets raises many types; all mean "could not get this data"
        raise DataError(f"could not load dataset {args[0]!r}: {e}. Use a built-in task ({', '.join(tasks.TASKS)}), "
                        "a local .jsonl/.json/.csv/.parquet file (the first three also .gz), or a Hugging Face "
                        "dataset id") from e


def heldout_rows(dataset: Any, eval_dataset: Any, max_samples: int, eval_split: str = "test",
                 system_prompt: str | None = None, dataset_config: str | None = None) -> list[dict] | None:
    """Rows for the before/after evaluation: ``eval_dataset`` if given (its ``eval_split`` when it
    is a built-in task or a Hugging Face id; ``dataset_config`` when it is ``dataset``), else the held-out
    split of a built-in task, else None (no evaluation). At most ``max_samples`` rows."""
    if max_samples == 0:
        return None
    if eval_dataset is not None:
        rows = load_rows(eval_dataset, split=eval_split, system_prompt=system_prompt,
                         config=dataset_config if eval_dataset == dataset else None)
    elif isinstance(dataset, str) and dataset in tasks.TASKS:
        rows = load_rows(dataset, split="test", system_prompt=system_prompt)
    else:
        return None
    return rows[:max_samples]


def shared_prompts(train_rows: list[dict], eval_rows: list[dict]) -> int:
    """How many held-out rows have a prompt that is also a training prompt."""
    seen = {repr(row["prompt"]) for row in train_rows}
    return sum(repr(row["prompt"]) in seen for row in eval_rows)


def check_rows(rows: list[dict], source: str) -> None:
    """Every row has a non-empty prompt in chat or plain format, and the same columns, none of them
    named like an argument the trainer itself passes to reward functions."""
    if not rows:
        raise DataError(f"{source}: the dataset is empty")
    if "prompt" not in rows[0]:
        raise DataError(f"{source}: no 'prompt' column (columns: {', '.join(rows[0]) or 'none'}); rename the column "
                        "holding the prompts to 'prompt', or give GSM8K-style 'question'/'answer' columns")
    reserved = next((column for column in rows[0] if column in TRAINER_REWARD_ARGS), None)
    if reserved is not None:
        raise DataError(f"{source}: column {reserved!r} has the name of an argument the trainer passes to every reward "
                        f"function ({', '.join(sorted(TRAINER_REWARD_ARGS))}); rename the column, and the reward "
                        "function parameter that reads it")
    columns = set(rows[0])
    for i, row in enumerate(rows):
        if set(row) != columns:
            raise DataError(f"{source}, row {i}: columns {sorted(row)} differ from the first row's {sorted(columns)}")
        prompt = row["prompt"]
        if prompt is EMPTY_PROMPT:  # the environment's reset() writes it
            continue
        if isinstance(prompt, str):
            ok = bool(prompt.strip())
        else:
            ok = isinstance(prompt, list) and len(prompt) > 0 and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and valid_content(m.get("content"))
                for m in prompt) and any(_says_something(m["content"]) for m in prompt)
        if not ok:
            raise DataError(f"{source}, row {i}: 'prompt' must be a non-empty string or a list of "
                            f"{{'role': ..., 'content': ...}} messages (content: a string, or a list of "
                            f"{{'type': 'text', 'text': ...}} and {{'type': 'image'}} parts), got {prompt!r:.120}")


def _says_something(content) -> bool:
    """A message's content has text or a picture."""
    if isinstance(content, str):
        return bool(content.strip())
    return any(part["type"] == "image" or part["text"].strip() for part in content)


def is_conversational(rows: list[dict]) -> bool:
    return isinstance(rows[0]["prompt"], list)


def extra_columns(rows: list[dict]) -> dict[str, list]:
    """The columns passed to reward functions: everything but the prompt."""
    return {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
