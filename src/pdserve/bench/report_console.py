"""The console bench tables print to: rich wraps a table at 80 columns in a pipe, which breaks logs."""

from __future__ import annotations

from rich.console import Console

LOG_WIDTH = 160


def report_console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=LOG_WIDTH)
