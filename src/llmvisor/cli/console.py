"""Consoles of the command line, and printing a table whole when the output is not a terminal.

Piped, rich assumes 80 columns (or $COLUMNS) and wraps a wide table cell by cell, so one row spreads over
several lines; `print_table` prints it as wide as its widest row instead. Text lines use soft wrapping,
so a pipe gets one line per message. `stdout_to_stderr` keeps stdout for a command's JSON alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)

UNLIMITED_WIDTH = 10_000


def table_width(console: Console, table: Table) -> int:
    """Columns the table needs with no cell wrapped."""
    return Measurement.get(console, console.options.update_width(UNLIMITED_WIDTH), table).maximum


def print_table(table: Table, console: Console = stdout) -> None:
    """On a terminal as rich lays it out; otherwise at the table's full width, one line per row."""
    if console.is_terminal:
        console.print(table, soft_wrap=False)
        return
    width = max(console.width, table_width(console, table))
    Console(file=console.file, width=width, color_system=None, highlight=False).print(table, soft_wrap=False)


@contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """Send file descriptor 1 to stderr while an engine runs, so a command's stdout holds only its JSON:
    vLLM logs to stdout, and torch or OpenMP may write to the descriptor directly. Disabled, it changes nothing."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
