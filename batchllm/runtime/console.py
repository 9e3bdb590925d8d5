"""The console a run talks to a person through (progress lines, plan notes, the summary)."""

from __future__ import annotations

from typing import IO

from rich.console import Console


def run_console(file: IO[str] | None = None) -> Console:
    """stderr (or `file`), with no line broken at the console's width: in a log or a pipe a
    long path or note stays on one line (a terminal wraps it for the eye)."""
    return Console(file=file, stderr=file is None, soft_wrap=True)
