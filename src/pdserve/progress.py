"""Progress for long work (a model's first fetch and conversion, loadgen runs), drawn on stderr and only
when stderr is a terminal: logs, pipes and CI never get a bar's redraws, and stdout stays the result."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)


@contextmanager
def counting(description: str, total: int) -> Iterator[Callable[[], None]]:
    """A bar over `total` units of work; call the yielded function once per unit done."""
    with _progress(BarColumn(), MofNCompleteColumn()) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)


@contextmanager
def stages(description: str) -> Iterator[Callable[[str], None]]:
    """A spinner and the time so far for work whose parts have no count; call the yielded function with
    the name of each part as it starts."""
    with _progress() as bar:
        task = bar.add_task(description, total=None)
        yield lambda stage: bar.update(task, description=f"{description}: {stage}")


def _progress(*columns: ProgressColumn) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        *columns,
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not sys.stderr.isatty(),
    )
