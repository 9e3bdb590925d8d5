"""Reading a 10,000,000-row input in bounded memory: open (validation with the duplicate-id
check), fingerprint, the whole file in windows, sparse takes, and the driver's peak RSS.

    .venv/bin/python benchmarks/input_scale.py [--rows 10000000] [--row-group-rows 1048576]

The file (an id and a ~150-character prompt per row; pyarrow's default row groups of 1Mi
rows unless told) is written by a child process into a temporary folder, so the peak RSS
printed is the reading's alone. Prints one line per phase: seconds and peak RSS so far.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from peak_rss import peak_rss_mb  # this folder's: the process's own peak, not its parent's

from batchllm.runtime.node_feed import ADMIT_WINDOW_ROWS as WINDOW_ROWS  # the rows a feed reads at once

WRITE_CHUNK_ROWS = 1_000_000
WORDS_PER_PROMPT = 24


def write_file(path: Path, rows: int, row_group_rows: int) -> None:
    """~150-character prompts of random words (so they compress as text does), ids `q<position>`."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rng = np.random.default_rng(13)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    vocabulary = pa.array(["".join(map(chr, rng.choice(letters, rng.integers(3, 10)))) for _ in range(4096)])
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, WRITE_CHUNK_ROWS):
            count = min(WRITE_CHUNK_ROWS, rows - start)
            ids = pc.binary_join_element_wise("q", pc.cast(pa.array(np.arange(start, start + count)), pa.string()), "")
            words = [vocabulary.take(pa.array(rng.integers(0, len(vocabulary), count))) for _ in range(WORDS_PER_PROMPT)]
            prompts = pc.binary_join_element_wise("Summarize:", *words, " ")
            writer.write_table(pa.table({"id": ids, "prompt": prompts}, schema=schema), row_group_size=row_group_rows)


def measure(path: Path) -> None:
    import pyarrow.parquet as pq

    from batchllm.dag.model import InputSpec
    from batchllm.io.input_source import open_input

    def report(phase: str, seconds: float, extra: str = "") -> None:
        print(f"{phase:<44} {seconds:8.2f} s   peak RSS {peak_rss_mb():7.0f} MB  {extra}", flush=True)

    report("imports", 0.0)
    started = time.perf_counter()
    source = open_input(InputSpec("prompts", path, "id", 1))
    report("open_input (incl. null + duplicate id check)", time.perf_counter() - started,
           f"{source.num_rows:,} rows, {path.stat().st_size / 1e9:.2f} GB, {pq.read_metadata(path).num_row_groups} row groups")

    started = time.perf_counter()
    source.fingerprint()
    seconds = time.perf_counter() - started
    report("fingerprint (sha256 of the file)", seconds, f"{path.stat().st_size / 1e9 / seconds:.2f} GB/s")

    started, rows = time.perf_counter(), 0
    for start in range(0, source.num_rows, WINDOW_ROWS):
        rows += source.read(start, start + WINDOW_ROWS, ["id", "prompt"]).num_rows
    seconds = time.perf_counter() - started
    report(f"read all in windows of {WINDOW_ROWS:,} rows", seconds, f"{rows:,} rows, {rows / seconds / 1e6:.1f} M rows/s")

    started, count = time.perf_counter(), 0
    for start in range(0, source.num_rows, WINDOW_ROWS):
        count += len(source.row_ids(start, start + WINDOW_ROWS))
    report("row_ids of all in windows", time.perf_counter() - started, f"{count:,} ids")

    rng = np.random.default_rng(1)
    span = 8 * WINDOW_ROWS
    starts = range(0, source.num_rows - span, source.num_rows // 200)
    started = time.perf_counter()
    for start in starts:
        source.take(np.sort(rng.choice(span, 4_096, replace=False)) + start, ["prompt"])
    seconds = time.perf_counter() - started
    report(f"take 4,096 rows over {span:,}, 200 places forward", seconds, f"{seconds / len(starts) * 1000:.0f} ms a take")

    started = time.perf_counter()
    source.read(source.num_rows // 2 + 500_000, source.num_rows // 2 + 500_000 + WINDOW_ROWS, ["prompt"])
    source.read(source.num_rows // 2, source.num_rows // 2 + WINDOW_ROWS, ["prompt"])
    report("two windows behind every cursor (worst case)", time.perf_counter() - started)

    started = time.perf_counter()
    source.head(1000)
    report("head(1000)", time.perf_counter() - started)
    source.close()
    print(f"peak RSS {peak_rss_mb() / 1024:.2f} GB over {source.num_rows:,} rows")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--row-group-rows", type=int, default=1024 * 1024)
    parser.add_argument("--write-only", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_only:
        write_file(args.write_only, args.rows, args.row_group_rows)
        return
    with tempfile.TemporaryDirectory(prefix="batchllm-input-scale-") as folder:
        path = Path(folder) / "prompts.parquet"
        started = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--row-group-rows", str(args.row_group_rows),
                        "--write-only", str(path)], check=True)
        print(f"wrote {args.rows:,} rows in {time.perf_counter() - started:.1f} s (child process)", flush=True)
        measure(path)


if __name__ == "__main__":
    main()
