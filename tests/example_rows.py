"""The example DAGs on fewer rows, for the tests that run them on the real engine: the same
nodes, prompts and outputs, over the first rows of the examples they read (an engine of this
machine kind takes 10-15x longer on a host without AVX-512; a test is about behaviour, and the
benchmarks are about scale)."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent


def example_dag(name: str, folder: Path, rows: int, whole: tuple[str, ...] = ()) -> Path:
    """A copy of dags/<name>.yaml in `folder` whose inputs are the first `rows` rows of the examples it
    reads, but for the files named in `whole` (a retrieval corpus, say), kept whole."""
    text = (REPO / "dags" / f"{name}.yaml").read_text()
    for found in sorted(set(re.findall(r"path: \.\./examples/(\S+\.parquet)", text))):
        table = pq.read_table(REPO / "examples" / found)
        pq.write_table(table if found in whole else table.slice(0, rows), folder / found)
        text = text.replace(f"path: ../examples/{found}", f"path: {folder / found}")
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path

