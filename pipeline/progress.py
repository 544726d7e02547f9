"""Rich progress bars for long steps, shared by every stage."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .console import make_console

console = make_console(stderr=True)


def _enabled() -> bool:
    return os.environ.get("FORGE_PROGRESS", "1") != "0"


@contextlib.contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """Yield an ``advance(n=1)`` callable; draws a bar on stderr unless FORGE_PROGRESS=0."""
    if not _enabled():
        yield lambda n=1: None
        return
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=not sys.stderr.isatty()) as prog:
        task = prog.add_task(description, total=total)
        yield lambda n=1: prog.advance(task, n)
