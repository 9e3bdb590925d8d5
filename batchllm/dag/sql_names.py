"""The names a `where:` predicate may read, found without parsing SQL (the loader checks
them against the columns and nodes a DAG has; DuckDB evaluates the predicate later)."""

from __future__ import annotations

import re

_SQL_STRING = re.compile(r"'(?:[^']|'')*'")
_SQL_WORD = re.compile(r'"([^"]+)"|([A-Za-z_][A-Za-z0-9_]*)')


def sql_identifiers(predicate: str) -> set[str]:
    """Every word of a predicate outside string literals: the names it may read (and its
    keywords, which match no column)."""
    without_strings = _SQL_STRING.sub(" ", predicate)
    return {quoted or bare for quoted, bare in _SQL_WORD.findall(without_strings)}
