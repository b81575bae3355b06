"""Output for logs: where standard output is not a terminal (a CI log, ``| tee``, a file), or with
``--plain`` (``COVEY_PLAIN=1`` in the environment), tables print as plain lines, one row per line, each
cell whole, and no message is wrapped at the console's width; the progress bar gives way to a line per
logged step.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table
from rich.text import Text

VARIABLE = "COVEY_PLAIN"  # "1": plain lines on a terminal too (what --plain sets)
SEPARATOR = "  "


def is_plain(console: Console) -> bool:
    """Plain lines: asked for, or output that no terminal (nor a notebook, which rich draws in) shows."""
    return os.environ.get(VARIABLE) == "1" or not (console.is_terminal or console.is_jupyter)


def output_console(stderr: bool = False) -> Console:
    """A console for covey's output: on a terminal as rich draws it; for a log, lines never wrapped."""
    console = Console(stderr=stderr)
    if is_plain(console):
        console.soft_wrap = True  # a message as one line, whatever its length
        console.no_color = True
    return console


def cell_text(cell: object) -> str:
    """A cell as one line of plain text: its markup removed, line breaks written as \\n."""
    text = Text.from_markup(cell).plain if isinstance(cell, str) else str(cell)
    return text.strip().replace("\r", "").replace("\n", "\\n")


def table_lines(table: Table) -> list[str]:
    """The title, the column names, then one line per row: cells apart by two spaces, an empty cell as
    '-', empty cells at the end of a row left out."""
    columns = [[cell_text(c) for c in column.cells] for column in table.columns]
    lines = [f"{cell_text(table.title)}:"] if table.title else []
    lines.append(SEPARATOR.join(cell_text(column.header) or "-" for column in table.columns))
    for row in zip(*columns):
        cells = list(row)
        while cells and not cells[-1]:
            cells.pop()
        lines.append(SEPARATOR.join(c or "-" for c in cells))
    return lines


def print_table(console: Console, table: Table) -> None:
    """``table`` drawn as rich draws it on a terminal, as plain lines for a log."""
    if not is_plain(console):
        console.print(table)
        return
    for line in table_lines(table):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
