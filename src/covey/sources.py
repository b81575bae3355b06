"""Names of what a run loads that are not files: the embedded default model, and the marker a run's
saved config puts where something was passed in memory (a model object, rows, a function)."""

from __future__ import annotations

from typing import Any

EMBEDDED_MODEL = "embedded:smollm2-135m-instruct"
IN_MEMORY = "<in-memory "


def in_memory(what: str) -> str:
    """How a run's saved config notes what a file cannot name: a model object, rows or a function passed
    in memory."""
    return f"{IN_MEMORY}{what}>"


def why_unloadable(value: Any, field: str) -> str | None:
    """For a value a saved config notes as passed in memory (``in_memory``), why it cannot be loaded;
    else None."""
    if isinstance(value, str) and value.startswith(IN_MEMORY):
        return (f"{field} {value!r} is how a run's config.yaml notes what was passed in memory, not something to "
                "load: give a file, folder, hub id or name in its place (for covey eval: --eval-dataset FILE)")
    return None
