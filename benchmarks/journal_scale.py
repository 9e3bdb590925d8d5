"""The node journal and the output files at 10,000,000 records, in one process.

    .venv/bin/python benchmarks/journal_scale.py [--records 10000000] [--batch 1000]

Appends `--records` short results to a `ResultJournal` (default segment_records, 50,000) in
batches of `--batch`, rows in roughly increasing order (each block of 65,536 rows shuffled,
as a pipelined run commits them), then closes it, reopens it and prints one line per phase:
seconds, a rate where it means something, and the process's peak RSS so far
(VmHWM: the whole process, DuckDB included; see peak_rss.py). The input file for the node file
and the data set (an int64 id and a short prompt per row) is written first, by a child
process, so its memory is not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from peak_rss import peak_rss_mb  # this folder's: the process's own peak, not its parent's

from batchllm.runtime.node_feed import ADMIT_WINDOW_ROWS as WINDOW_ROWS  # the rows a feed reads at once

SHUFFLE_BLOCK_ROWS = 65_536
WRITE_CHUNK_ROWS = 1_000_000


def write_input(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.int64()), ("prompt", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, WRITE_CHUNK_ROWS):
            ids = pa.array(np.arange(start, min(rows, start + WRITE_CHUNK_ROWS), dtype=np.int64))
            prompts = pc.binary_join_element_wise("question ", pc.cast(ids, pa.string()), "")
            writer.write_table(pa.table({"id": pc.multiply(ids, 7), "prompt": prompts}, schema=schema))


def report(phase: str, seconds: float, extra: str = "") -> None:
    print(f"{phase:<40} {seconds:8.2f} s   peak RSS {peak_rss_mb():6.0f} MB   {extra}", flush=True)


def append_order(records: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    order = np.arange(records, dtype=np.int64)
    for start in range(0, records, SHUFFLE_BLOCK_ROWS):
        rng.shuffle(order[start:start + SHUFFLE_BLOCK_ROWS])
    return order


def measure(folder: Path, input_path: Path, records: int, batch: int) -> None:
    from batchllm.dag.model import ColumnRef, OutputSpec
    from batchllm.io.journal_records import ResultRecord
    from batchllm.io.node_journal import ResultJournal
    from batchllm.io.output_files import FinalSource, InputFile, write_node_file, write_output_set

    report("imports", 0.0)
    order = append_order(records)
    journal_folder = folder / ".batchllm" / "journal" / "gen"
    journal = ResultJournal(journal_folder, "fp", "gen")
    appending = building = 0.0
    for start in range(0, records, batch):
        began = time.perf_counter()
        chunk = [ResultRecord(row, 0, (f"answer {row}",), 20, 3, "stop") for row in order[start:start + batch].tolist()]
        built = time.perf_counter()
        journal.append_many(chunk)
        building += built - began
        appending += time.perf_counter() - built
    began = time.perf_counter()
    journal.close()
    appending += time.perf_counter() - began
    report(f"append {records:,} in batches of {batch:,}", appending,
           f"{records / appending:,.0f} records/s (+ {building:.1f} s building the records)")
    del order

    began = time.perf_counter()
    journal = ResultJournal(journal_folder, "fp", "gen")
    opened = time.perf_counter() - began
    rows, steps = journal.committed_keys()
    keyed = time.perf_counter() - began
    report("reopen", opened, f"{len(journal.segment_paths())} segments, stats {journal.stats()}")
    report("reopen + committed_keys", keyed, f"{len(rows):,} keys")
    assert len(rows) == records and int(rows.sum()) == records * (records - 1) // 2
    del rows, steps

    for label, first in (("texts() window, cold", records // 2), ("texts() next window", records // 2 + WINDOW_ROWS)):
        window = np.arange(first, min(records, first + WINDOW_ROWS), dtype=np.int64)
        began = time.perf_counter()
        texts = journal.texts(window, np.zeros(len(window), np.int32))
        report(f"{label} ({len(window):,} rows)", time.perf_counter() - began)
        assert texts == [f"answer {row}" for row in window.tolist()]

    source = InputFile(input_path, "id")
    began = time.perf_counter()
    write_node_file(journal, source, folder / "nodes" / "gen.parquet")
    report("write node file", time.perf_counter() - began)
    spec = OutputSpec("results", "questions", {"prompt": ColumnRef(None, "prompt"), "answer": ColumnRef("gen", "text"),
                                               "tokens": ColumnRef("gen", "num_output_tokens")}, 0)
    began = time.perf_counter()
    write_output_set(spec, source, {"gen": FinalSource(journal, None)}, {}, folder / "results.parquet")
    report("write output set", time.perf_counter() - began)
    journal.close()

    import pyarrow.parquet as pq
    for name in ("nodes/gen.parquet", "results.parquet"):
        metadata = pq.read_metadata(folder / name)
        assert metadata.num_rows == records, (name, metadata.num_rows)
    journal_mb = sum(p.stat().st_size for p in journal_folder.iterdir()) / 2**20
    print(f"journal on disk: {journal_mb:,.0f} MB; node file {(folder / 'nodes/gen.parquet').stat().st_size / 2**20:,.0f} MB",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--keep", type=Path, help="write into this (new) folder and keep it, instead of a temporary one")
    parser.add_argument("--write-input", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_input:
        write_input(args.write_input, args.records)
        return
    if args.keep:
        args.keep.mkdir(parents=True)
    with (contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory(prefix="journal-scale-")) as folder:
        input_path = Path(folder) / "questions.parquet"
        began = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--records", str(args.records), "--write-input", str(input_path)], check=True)
        print(f"input of {args.records:,} rows written by a child in {time.perf_counter() - began:.1f} s", flush=True)
        measure(Path(folder), input_path, args.records, args.batch)


if __name__ == "__main__":
    main()
