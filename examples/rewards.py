"""Example reward functions in TRL's convention: one float (or None) per completion."""


def brevity(completions, **kwargs):
    """Small penalty for every 100 characters, so answers stay to the point."""
    return [-len(c[0]["content"]) / 100 if isinstance(c, list) else -len(c) / 100 for c in completions]


def mentions_units(completions, unit=None, **kwargs):
    """Rewards naming the unit the dataset's `unit` column asks for; not applicable without one."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    units = unit or [None] * len(texts)
    return [None if u is None else float(u in t) for t, u in zip(texts, units)]
