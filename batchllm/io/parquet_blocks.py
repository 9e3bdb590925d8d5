"""Rows of a Parquet file by position, decoded in blocks: slices of a row group of bounded size.

Invariant: memory held here is bounded whatever the file's size: at most `CACHE_BYTES` of
decoded blocks (plus the newest block, however large) and `OPEN_CURSORS` live reads, each
holding a page buffer. A block is `block_rows` consecutive rows of one row group (fewer at the
group's end), sized from a probe of the first rows so that it decodes to about `BLOCK_BYTES`:
a row group of a million long documents is never decoded whole.

A cursor is a live read through one row group; reading forward continues it, so consecutive
windows decode every block once. Reading behind every open cursor and outside the cached
blocks restarts at the row group's first row (Parquet has no cheaper way into a row group).
Tables returned are compact copies: a caller keeping one keeps only its own rows.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

BLOCK_BYTES = 8 << 20  # decoded size a block aims at (~50,000 rows of 150-character prompts)
CACHE_BYTES = 32 << 20  # decoded blocks kept for re-reads (the newest is kept whatever its size)
MIN_BLOCK_ROWS, MAX_BLOCK_ROWS = 1_024, 262_144
OPEN_CURSORS = 4
PROBE_ROWS = 1_024
READ_BUFFER_BYTES = 1 << 20  # stream a column chunk's pages through this buffer, never read it whole


@dataclass(frozen=True)
class Block:
    start_row: int
    table: pa.Table

    @property
    def stop_row(self) -> int:
        return self.start_row + self.table.num_rows

    def holds(self, row: int, columns: Sequence[str]) -> bool:
        return self.start_row <= row < self.stop_row and all(c in self.table.column_names for c in columns)


class _Cursor:
    """A live read through one row group, `block_rows` rows at a time."""

    def __init__(self, path: Path, metadata: pq.FileMetaData, group: int, first_row: int, columns: tuple[str, ...],
                 block_rows: int):
        self.group, self.columns, self.next_row = group, columns, first_row
        self._file = pq.ParquetFile(path, metadata=metadata, pre_buffer=False, buffer_size=READ_BUFFER_BYTES)
        self._batches: Iterator[pa.RecordBatch] = self._file.iter_batches(
            batch_size=block_rows, row_groups=[group], columns=list(columns), use_threads=False)

    def can_reach(self, group: int, row: int, columns: Sequence[str]) -> bool:
        return self.group == group and self.next_row <= row and all(c in self.columns for c in columns)

    def next_block(self) -> Block:
        batch = next(self._batches)
        block = Block(self.next_row, pa.Table.from_batches([batch]))
        self.next_row += batch.num_rows
        return block

    def close(self) -> None:
        self._file.close()


class BlockReader:
    """Windows and sparse rows of one Parquet file; thread-safe (one lock)."""

    def __init__(self, path: Path, metadata: pq.FileMetaData):
        self.path, self.metadata = path, metadata
        self.schema: pa.Schema = metadata.schema.to_arrow_schema()
        self.num_rows: int = metadata.num_rows
        sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        self._group_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._bytes_per_row = self._probe()
        self._blocks: list[Block] = []  # most recently used last
        self._cursors: list[_Cursor] = []  # most recently used last
        self._lock = threading.Lock()

    def _probe(self) -> dict[str, float]:
        """Decoded bytes per row of each column, from the first rows (not from the footer:
        a dictionary-encoded column decodes to far more than its Parquet size)."""
        if not self.num_rows:
            return {name: 0.0 for name in self.schema.names}
        with pq.ParquetFile(self.path, metadata=self.metadata, pre_buffer=False, buffer_size=READ_BUFFER_BYTES) as probe:
            batch = next(probe.iter_batches(batch_size=PROBE_ROWS, row_groups=[0], use_threads=False))
        return {name: batch.column(name).nbytes / max(batch.num_rows, 1) for name in self.schema.names}

    def block_rows(self, columns: Sequence[str]) -> int:
        per_row = sum(self._bytes_per_row[c] for c in columns)
        rows = int(BLOCK_BYTES / per_row) if per_row > 0 else MAX_BLOCK_ROWS
        return min(max(rows, MIN_BLOCK_ROWS), MAX_BLOCK_ROWS)

    # -- reading -------------------------------------------------------------------------
    def read(self, start: int, stop: int, columns: Sequence[str]) -> pa.Table:
        columns = self._checked(columns)
        stop = min(stop, self.num_rows)
        if start < 0 or start > stop:
            raise ValueError(f"bad row window [{start}, {stop}) of a file of {self.num_rows} rows")
        if not columns:
            return _no_columns(stop - start)
        with self._lock:
            pieces, row = [], start
            while row < stop:
                block = self._block_at(row, columns)
                end = min(stop, block.stop_row)
                pieces.append(self._copy(block, np.arange(row - block.start_row, end - block.start_row), columns))
                row = end
        return self._joined(pieces, columns)

    def take(self, rows: np.ndarray, columns: Sequence[str]) -> pa.Table:
        columns = self._checked(columns)
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows[0] < 0 or rows[-1] >= self.num_rows or (np.diff(rows) < 0).any()):
            raise ValueError(f"rows must be sorted positions in [0, {self.num_rows})")
        if not columns:
            return _no_columns(len(rows))
        with self._lock:
            pieces, i = [], 0
            while i < len(rows):
                block = self._block_at(int(rows[i]), columns)
                j = int(np.searchsorted(rows, block.stop_row, side="left"))
                pieces.append(self._copy(block, rows[i:j] - block.start_row, columns))
                i = j
        return self._joined(pieces, columns)

    def batches(self, columns: Sequence[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
        """The whole file in order, outside the cache (one pass over a column)."""
        with pq.ParquetFile(self.path, metadata=self.metadata, pre_buffer=False, buffer_size=READ_BUFFER_BYTES) as handle:
            yield from handle.iter_batches(batch_size=batch_rows, columns=self._checked(columns), use_threads=False)

    def close(self) -> None:
        with self._lock:
            for cursor in self._cursors:
                cursor.close()
            self._cursors, self._blocks = [], []

    # -- blocks and cursors ----------------------------------------------------------------
    def _block_at(self, row: int, columns: list[str]) -> Block:
        for block in reversed(self._blocks):
            if block.holds(row, columns):
                self._blocks.remove(block)
                self._blocks.append(block)
                return block
        group = int(np.searchsorted(self._group_starts, row, side="right")) - 1
        reaching = [c for c in self._cursors if c.can_reach(group, row, columns)]
        if reaching:
            cursor = max(reaching, key=lambda c: c.next_row)
            self._cursors.remove(cursor)
        else:
            cursor = _Cursor(self.path, self.metadata, group, int(self._group_starts[group]), tuple(columns),
                             self.block_rows(columns))
        block = cursor.next_block()
        while block.stop_row <= row:
            block = cursor.next_block()
        if cursor.next_row < self._group_starts[group + 1]:
            self._cursors.append(cursor)
            while len(self._cursors) > OPEN_CURSORS:
                self._cursors.pop(0).close()
        else:
            cursor.close()
        self._remember(block)
        return block

    def _remember(self, block: Block) -> None:
        self._blocks.append(block)
        total = sum(b.table.nbytes for b in self._blocks)
        while len(self._blocks) > 1 and total > CACHE_BYTES:
            total -= self._blocks.pop(0).table.nbytes

    def _checked(self, columns: Sequence[str]) -> list[str]:
        unknown = [c for c in columns if c not in self.schema.names]
        if unknown:
            raise KeyError(f"no column {unknown[0]!r} in {str(self.path)!r} (columns: {', '.join(self.schema.names)})")
        return list(columns)

    @staticmethod
    def _copy(block: Block, indices: np.ndarray, columns: list[str]) -> pa.Table:
        return block.table.select(columns).take(pa.array(indices, pa.int64()))

    def _joined(self, pieces: list[pa.Table], columns: list[str]) -> pa.Table:
        if not pieces:
            return self.schema.empty_table().select(columns)
        return pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]


def _no_columns(rows: int) -> pa.Table:
    """A table of `rows` rows and no column (Arrow keeps the count through `select([])`)."""
    return pa.table({"_": pa.nulls(rows)}).select([])
