"""Errors covey reports to the user: each says what is wrong, where, and how to fix it; and its warnings."""

import logging
import warnings


class CoveyError(ValueError):
    """Bad input (config, data, model, reward function); reported as one line, before heavy work."""


class ConfigError(CoveyError):
    pass


class DataError(CoveyError):
    pass


class ModelError(CoveyError):
    pass


class RewardError(CoveyError):
    pass


class NumericsError(CoveyError):
    """Training produced NaN or inf too many steps in a row."""


class CheckpointError(CoveyError):
    """A checkpoint could not be written or read; the previous one is left as it was."""


class HubError(CoveyError):
    """push_to_hub cannot reach the Hugging Face Hub, the Hub refuses the token, or a push failed."""


class TrainingInterrupted(CoveyError):
    """SIGINT or SIGTERM stopped the run after a checkpoint was saved."""

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.signal_number = signal_number


def config_errors(problems: list[str], source: str | None = None) -> ConfigError:
    """One error saying every problem of a config (``source``: where it came from); the list stays
    on it as ``problems``."""
    where = f"{source}: " if source else ""
    error = ConfigError(where + problems[0] if len(problems) == 1 else
                        f"{where}{len(problems)} problems:\n- " + "\n- ".join(problems))
    error.problems = problems
    return error




# the logger TRL's GRPO trainer warns through: covey's warnings reach it too, so that handlers and pytest's
# caplog set up for TRL see them
TRL_LOGGER = "trl.trainer.grpo_trainer"


def warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """Warn the user once: through Python's ``warnings`` (``stacklevel`` counts from the caller, as there),
    and to TRL's logger where a handler listens to it. Where such a handler shows the record and nothing
    records warnings (pytest does, and ``warnings.catch_warnings(record=True)``), the warnings module's own
    line is left out: one warning is printed once."""
    logger = logging.getLogger(TRL_LOGGER)
    if logger.isEnabledFor(logging.WARNING) and logger.hasHandlers():
        logger.warning(message)
        if not _warnings_recorded():
            return
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def _warnings_recorded() -> bool:
    """Whether warnings are being recorded rather than printed (a catch_warnings(record=True) block)."""
    return getattr(warnings, "_showwarnmsg_impl", None) is not _PRINTED_BY


_PRINTED_BY = getattr(warnings, "_showwarnmsg_impl", None)
