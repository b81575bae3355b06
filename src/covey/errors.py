"""Errors covey reports to the user: each says what is wrong, where, and how to fix it."""


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


