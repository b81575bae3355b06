"""How much transformers says while covey runs: its progress bars off, its log level the config's."""

from __future__ import annotations

LIBRARY_LOG_LEVEL = ["error"]  # transformers' verbosity while covey runs: the config's log_level, if not passive


def quiet_transformers() -> None:
    """Our own progress display replaces the library's per-file loading bars; transformers says what
    log_level asks for (by default errors only)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity(logging.log_levels[LIBRARY_LOG_LEVEL[0]])


def set_log_level(level: str) -> None:
    """log_level, as in transformers' Trainer: the verbosity of transformers (passive: covey's choice, errors)."""
    LIBRARY_LOG_LEVEL[0] = "error" if level == "passive" else level
    quiet_transformers()
