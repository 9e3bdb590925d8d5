"""Typed reads from one mapping of a DAG file, with errors that name the key path and line."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from batchllm.core.errors import UserError
from batchllm.dag.yaml_lines import LineDict

NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")  # of inputs, nodes, merges, nearest lists and outputs


class Section:
    """Typed reads from one YAML mapping, with errors that name `where` and the line."""

    def __init__(self, file: Path, mapping: object, where: str, line: int, allowed: set[str]):
        self.file, self.where = file, where
        if not isinstance(mapping, LineDict):
            raise UserError(f"{where} must be a mapping, got {show(mapping)}", where=place(file, line, where))
        self.mapping = mapping
        for key in mapping:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(sorted(allowed))}"
                self.fail(key, f"unknown key {key!r} in {where}", hint)

    def fail(self, key: str | None, message: str, hint: str | None = None) -> NoReturn:
        line = self.mapping.line_of(key) if key else self.mapping.line
        top = self.where == "the DAG"
        path = ("" if top else self.where) if key is None else (str(key) if top else f"{self.where}.{key}")
        raise UserError(message, where=place(self.file, line, path), hint=hint)

    def line(self, key: str) -> int:
        return self.mapping.line_of(key)

    def get(self, key: str, kind: type | tuple[type, ...], default: object = ..., *, check: Callable[[Any], object] | None = None,
            expect: str = "") -> Any:
        if key not in self.mapping:
            if default is ...:
                self.fail(None, f"{self.where} needs the key {key!r}", f"add `{key}:` to {self.where}")
            return default
        value = self.mapping[key]
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if not ok or (check is not None and not check(value)):
            noun = expect or getattr(kind, "__name__", "value")
            self.fail(key, f"{self.where}.{key} must be {noun}, got {show(value)}")
        return value


def check_name(section: Section, key: str, kind: str) -> None:
    """A name the DAG gives (an input, a node, ...): letters, digits and _, not starting with a digit."""
    if not isinstance(key, str) or not NAME_PATTERN.match(key):
        section.fail(key, f"{kind} name {key!r} is not a valid name", "use letters, digits and _, not starting with a digit")


def names_section(top: Section, key: str, expect: str) -> Section | None:
    """A top-level mapping whose keys are names the DAG gives (`merges:`, `nearest:`); None when the DAG has none."""
    if key not in top.mapping:
        return None
    raw = top.get(key, dict, expect=expect)
    return Section(top.file, raw, key, top.line(key), set(raw))


def place(file: Path, line: int, key_path: str) -> str:
    """Where an error is: its line in a YAML file, else (a mapping from Python, which has no
    lines and no file) its key path."""
    if line:
        return f"{file}, line {line}"
    return key_path or "the DAG"


def show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def plain(value: object) -> object:
    """YAML's line-tracking mappings -> plain dicts and lists, for JSON."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
