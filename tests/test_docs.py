"""The docs a user reads: a short README, a CLI reference generated from the CLI itself,
relative links that point at files that exist, and a benchmarks table whose cells are read at a glance."""

from __future__ import annotations

import re
from pathlib import Path

from batchllm.cli_reference import reference

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_cli_reference_is_what_the_cli_says():
    assert (REPO / "docs" / "cli.md").read_text() == reference(), \
        "docs/cli.md is stale: run `python -m batchllm.cli_reference > docs/cli.md`"


def test_the_reference_has_every_command():
    text = reference()
    for command in ("run", "run-batch", "plan", "status", "validate", "profile", "models list", "models prepare"):
        assert f"## `batchllm {command}`" in text, command


def test_the_readme_is_short():
    assert len((REPO / "README.md").read_bytes()) <= 10_000


def test_relative_links_point_at_files_that_exist():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = [f"{page.relative_to(REPO)}: {target}" for page in pages for target in LINK.findall(page.read_text())
              if "://" not in target and not (page.parent / target).exists()]
    assert broken == []


MAX_CELL = 300  # a cell is read at a glance; a benchmark's history goes to its results files


def table_rows(markdown: str) -> list[list[str]]:
    """The cells of every row of the markdown tables in `markdown` (header rows too, not the
    `|---|` lines), split at the pipes outside `code` spans and not escaped (`\\|`)."""
    rows = []
    for line in markdown.splitlines():
        line = line.strip()
        if not line.startswith("|") or re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", line):
            continue
        cells, cell, in_code, escaped = [], "", False, False
        for char in line.strip("|"):
            if char == "|" and not in_code and not escaped:
                cells.append(cell.strip())
                cell = ""
                continue
            in_code ^= char == "`" and not escaped
            escaped = char == "\\" and not escaped
            cell += char
        rows.append([*cells, cell.strip()])
    return rows


def test_table_rows_splits_cells_at_the_pipes_of_the_table():
    text = "| a | b |\n|---|:---:|\n| `x | y` | z \\| w |\nnot a row | here\n"
    assert table_rows(text) == [["a", "b"], ["`x | y`", "z \\| w"]]


def test_the_benchmarks_table_has_short_cells():
    rows = table_rows((REPO / "docs" / "benchmarks.md").read_text())
    assert len(rows) > 10  # the table was found: a header and a row a benchmark
    assert all(len(row) == len(rows[0]) for row in rows)
    long = [f"{row[0][:40]}: {len(cell)} characters" for row in rows for cell in row if len(cell) > MAX_CELL]
    assert long == [], f"cells over {MAX_CELL} characters (move the detail to the row's results file)"
