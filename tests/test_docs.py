"""The docs a user reads: a short README, a CLI reference generated from the CLI itself,
and relative links that point at files that exist."""

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
