"""What covey verify reports: a check per invariant, PASS / WARN / FAIL with what to do, and the first
failing stage in the order of the loop."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from covey.errors import CoveyError

STAGES = ("setup", "data", "decode", "episodes", "rewards", "probes", "advantages", "logprobs", "images", "loss", "engine", "async")


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

    def run(self, stage: str, checks: Callable, *args):
        """``checks(*args)``, the checks of ``stage``; what it returns, or None where an error was raised on
        the way (the code under check, or a check itself): then that error is a FAIL of ``stage`` that names
        it and where it was raised, so that every stage ends in the report, never in a traceback."""
        try:
            return checks(*args)
        except Exception as e:
            self.add(stage, f"the {stage} checks run to the end", False, error_text(e),
                     "the code this stage runs raised an error where the message says; an error raised in "
                     "covey/verify itself is covey's bug: please report it with this message")
            return None

    @property
    def first_failure(self) -> str | None:
        failed = {c.stage for c in self.checks if c.status == "FAIL"}
        return next((s for s in self.stages if s in failed), None)


def error_text(error: BaseException) -> str:
    """What a report says of an error: covey's own message (it says what to do), or any other error's kind,
    message and the place it was raised."""
    if isinstance(error, CoveyError):
        return str(error)
    return f"{type(error).__name__}: {error} (at {error_place(error)})"


def error_place(error: BaseException) -> str:
    """The innermost frame of an error, as file:line in function (the file from its package folder on)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "an unknown place"
    path = Path(frames[-1].filename)
    parts = path.parts[path.parts.index("site-packages") + 1:] if "site-packages" in path.parts else path.parts[-2:]
    return f"{'/'.join(parts)}:{frames[-1].lineno} in {frames[-1].name}"


def exit_code(report: Report) -> int:
    """covey verify's exit code: 1 where a stage failed, else 0 (docs/verify.md lists them all)."""
    return 1 if report.first_failure else 0


def print_report(report: Report, console) -> int:
    """The checks as a table (as plain lines, one check per line, for a log), then the verdict; the exit code."""
    from rich.table import Table

    from covey.telemetry.plain import print_table

    table = Table(title="covey verify")
    for column in ("stage", "check", "status", "measured", "what to do"):
        table.add_column(column)
    colours = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}
    for c in report.checks:
        table.add_row(c.stage, c.name, f"[{colours[c.status]}]{c.status}[/]", c.value, c.hint)
    print_table(console, table)
    failed = report.first_failure
    if failed:
        console.print(f"[bold red]FAIL[/]: first failing stage: {failed}")
        return exit_code(report)
    warnings = sum(c.status == "WARN" for c in report.checks)
    console.print("[green]every stage passed[/]" + (f", [yellow]with {warnings} warning(s): see the WARN rows[/]"
                                                    if warnings else ""))
    return exit_code(report)


def report_data(report: Report) -> dict:
    """The report as data for CI gates (``covey verify --json``; the schema is in docs/verify.md)."""
    counts = {status: sum(c.status == status for c in report.checks) for status in ("PASS", "WARN", "FAIL")}
    code = exit_code(report)
    return {"verdict": "FAIL" if code else "WARN" if counts["WARN"] else "PASS", "exit_code": code,
            "first_failing_stage": report.first_failure, "counts": counts, "stages": list(report.stages),
            "checks": [{"stage": c.stage, "check": c.name, "status": c.status, "measured": c.value, "message": c.hint}
                       for c in report.checks]}
