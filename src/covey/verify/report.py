"""What covey verify reports: a check per invariant, PASS / WARN / FAIL with what to do, and the first
failing stage in the order of the loop."""

from __future__ import annotations

from dataclasses import dataclass

STAGES = ("setup", "data", "decode", "episodes", "rewards", "advantages", "logprobs", "loss", "engine", "async")


@dataclass
class Check:
    stage: str
    name: str
    value: str
    status: str  # PASS | WARN | FAIL
    hint: str = ""


class Report:
    def __init__(self, stages: tuple[str, ...] = STAGES) -> None:
        self.checks: list[Check] = []
        self.stages = stages  # in the order of the loop

    def add(self, stage: str, name: str, ok: bool, value: str, hint: str = "", warn_only: bool = False) -> bool:
        status = "PASS" if ok else ("WARN" if warn_only else "FAIL")
        self.checks.append(Check(stage, name, value, status, "" if ok else hint))
        return ok

    @property
    def first_failure(self) -> str | None:
        failed = {c.stage for c in self.checks if c.status == "FAIL"}
        return next((s for s in self.stages if s in failed), None)


def print_report(report: Report, console) -> int:
    from rich.table import Table

    table = Table(title="covey verify")
    for column in ("stage", "check", "measured", "status", "what to do"):
        table.add_column(column)
    colours = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}
    for c in report.checks:
        table.add_row(c.stage, c.name, c.value, f"[{colours[c.status]}]{c.status}[/]", c.hint)
    console.print(table)
    failed = report.first_failure
    if failed:
        console.print(f"[bold red]FAIL[/]: first failing stage: {failed}")
        return 1
    warnings = sum(c.status == "WARN" for c in report.checks)
    console.print("[green]every stage passed[/]" + (f", [yellow]with {warnings} warning(s): see the WARN rows[/]"
                                                    if warnings else ""))
    return 0
