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
