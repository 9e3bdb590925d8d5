"""Errors a user can act on. The CLI prints them as one paragraph and exits 2."""

from __future__ import annotations

from pathlib import Path

USAGE_EXIT_CODE = 2


class UserError(Exception):
    """Bad input: what is wrong, where, and how to fix it.

    `where` names the place (file, node, field, line); `hint` says how to fix it.
    """

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.where = where
        self.hint = hint

    def paragraph(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.hint:
            text += f". Fix: {self.hint}"
        return text if text.endswith(".") else text + "."


class RunIncomplete(Exception):
    """The run stopped with work left (a node failed). `outputs`: the data sets written with
    the results so far (marked incomplete in run.json; the run that completes replaces them)."""

    def __init__(self, message: str, outputs: dict[str, Path] | None = None):
        super().__init__(message)
        self.outputs = dict(outputs or {})
