"""What a reward-hacking or collapse rule reports: the pattern, where it began, the evidence, what to do."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Finding:
    key: str  # the health/<key> metric it is logged as
    kind: str  # gaming, collapse, drift, note
    began: int | None  # the step where the pattern began
    message: str  # what was seen, with the values
    advice: str  # what to do
    values: dict = field(default_factory=dict)
    examples: tuple[str, ...] = ()

    def text(self) -> str:
        """The finding as one plain-language warning."""
        where = "" if self.began is None else f" (from step {self.began})"
        shown = "".join(f"\n    e.g. {example!r}" for example in self.examples)
        return f"{self.message}{where}. {self.advice}{shown}"
