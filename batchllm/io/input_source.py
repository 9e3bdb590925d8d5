"""Input data sets: Parquet files read in windows, rows addressed by position, never held whole.

Every format is read as one Parquet file (`io.input_formats`: the user's own, or the source
converted once into a cache), whose path is `InputSource.path`; messages name the user's.
Invariant: a row is its 0-based position in its file. Its string id (`row_id`), written only
with outputs, is the `id_column` cast to string, else the position in decimal. `open_input`
refuses a file whose ids would not be unique and non-null, before anything runs, without
writing anything in the user's folders and in bounded memory (the duplicate check runs in
DuckDB under `ID_CHECK_MEMORY`, spilling to a temporary folder of the system's).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchllm.core.errors import UserError
from batchllm.dag.model import InputSpec
from batchllm.io.input_formats import parquet_input
from batchllm.io.parquet_blocks import BlockReader

ROW_ID = "row_id"
ID_CHECK_MEMORY = "256MB"
LENGTH_BATCH_ROWS = 65_536


class InputSource:
    """One input data set, read in batches; never held whole in memory. Built by `open_input`."""

    def __init__(self, spec: InputSpec, metadata: pq.FileMetaData, path: Path | None = None, digest: str | None = None):
        """`path`: the Parquet file holding the rows (default `spec.path`); `digest`: what the
        fingerprint names the data by (default: that file's sha256, computed when asked)."""
        self.spec, self.path, self.id_column = spec, path or spec.path, spec.id_column
        self._reader = BlockReader(self.path, metadata)
        self.num_rows: int = self._reader.num_rows
        self.schema: pa.Schema = self._reader.schema  # the file's columns (no row_id added)
        self._digest: str | None = digest

    def read(self, start: int, stop: int, columns: Sequence[str]) -> pa.Table:
        """Rows [start, stop) in file order (stop past the end reads to the end), only `columns`."""
        return self._reader.read(start, stop, columns)

    def take(self, rows: np.ndarray, columns: Sequence[str]) -> pa.Table:
        """The rows at these sorted positions, in that order, only `columns`."""
        return self._reader.take(rows, columns)

    def rows_at(self, rows: np.ndarray, columns: Sequence[str]) -> pa.Table:
        """The rows at these sorted positions as templates and `where:` see them: `columns` and `row_id`
        (string, last; a file's own `row_id` column is the id column and gives way to it)."""
        wanted = [c for c in columns if c != ROW_ID]
        table = self.take(rows, wanted + ([self.id_column] if self.id_column and self.id_column not in wanted else []))
        ids = (pc.cast(table.column(self.id_column), pa.string()) if self.id_column
               else pc.cast(pa.array(np.asarray(rows, np.int64)), pa.string()))
        return table.select(wanted).append_column(pa.field(ROW_ID, pa.string()), ids)

    def head(self, count: int) -> pa.Table:
        """The first `count` rows (fewer if the file has fewer), all columns."""
        return self.read(0, min(count, self.num_rows), self.schema.names)

    def head_rows(self, count: int) -> pa.Table:
        """The first rows as templates and `where:` see them: the file's columns and `row_id`
        (string, last; a file's own `row_id` column is the id column and gives way to it)."""
        table = self.head(count)
        if ROW_ID in table.column_names:
            table = table.drop_columns([ROW_ID])
        return table.append_column(pa.field(ROW_ID, pa.string()), self.row_ids(0, table.num_rows))

    def list_lengths(self, column: str) -> np.ndarray:
        """int32 per row: the length of a list column's value (0 for null), read batch by batch."""
        if not (pa.types.is_list(self.schema.field(column).type) or pa.types.is_large_list(self.schema.field(column).type)):
            raise TypeError(f"column {column!r} of {str(self.path)!r} is not a list column")
        lengths = np.empty(self.num_rows, np.int32)
        row = 0
        for batch in self._reader.batches([column], LENGTH_BATCH_ROWS):
            counts = pc.fill_null(pc.list_value_length(batch.column(0)), 0)
            lengths[row:row + batch.num_rows] = counts.to_numpy(zero_copy_only=False)
            row += batch.num_rows
        return lengths

    def row_ids(self, start: int, stop: int) -> pa.Array:
        """The rows' ids as strings: the id column cast to string, else the position."""
        stop = min(stop, self.num_rows)
        if self.id_column is None:
            return pc.cast(pa.array(np.arange(start, stop, dtype=np.int64)), pa.string())
        column = self.read(start, stop, [self.id_column]).column(0)
        return pc.cast(column, pa.string()).combine_chunks()

    def fingerprint(self) -> str:
        """What about the data decides results: the file's sha256 (a converted input: the
        digest of its source, see `io.input_formats`) and the id column (computed once per
        source; ~0.8 s a GB here, streamed in fixed buffers)."""
        if self._digest is None:
            self._digest = file_digest(self.path)
        return self._digest + (self.id_column or "")

    def close(self) -> None:
        self._reader.close()


def file_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def open_input(spec: InputSpec) -> InputSource:
    """Open and validate one input, of any format; every problem is a UserError naming the
    user's file, and a refused input leaves nothing behind (not even a converted copy)."""
    where = f"inputs.{spec.name}"
    parquet, metadata = parquet_input(spec, lambda path: _validated(spec, path, where))
    try:
        return InputSource(spec, metadata, parquet.path, parquet.digest)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{str(spec.path)!r} is not a readable Parquet file: {exc}", where=where) from None


def _validated(spec: InputSpec, path: Path, where: str) -> pq.FileMetaData:
    """The Parquet file's metadata, once its rows and ids are fit to run on."""
    try:
        metadata = pq.read_metadata(path)
        schema = metadata.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{str(spec.path)!r} is not a readable Parquet file: {exc}", where=where) from None
    if metadata.num_rows == 0:
        raise UserError(f"input file {str(spec.path)!r} has no rows", where=where, hint="point `path:` at a data set with at least one row")
    if ROW_ID in schema.names and spec.id_column != ROW_ID:
        raise UserError(f"input file has a column named {ROW_ID!r}, which batchllm reserves", where=where,
                        hint=f"set `id_column: {ROW_ID}` to use it as the row id, or rename it")
    if spec.id_column is not None:
        if spec.id_column not in schema.names:
            raise UserError(f"id_column {spec.id_column!r} is not a column of {str(spec.path)!r}", where=where,
                            hint=f"columns: {', '.join(schema.names)}")
        _check_ids(spec, path, where)
    return metadata


def open_inputs(specs: dict[str, InputSpec]) -> dict[str, InputSource]:
    return {name: open_input(spec) for name, spec in specs.items()}


def _check_ids(spec: InputSpec, path: Path, where: str) -> None:
    """No null and no duplicate id, in DuckDB: bounded memory, spilling to a temporary folder."""
    column = '"' + cast(str, spec.id_column).replace('"', '""') + '"'  # called only with an id_column
    with tempfile.TemporaryDirectory(prefix="batchllm-ids-") as spill:
        connection = duckdb.connect(config={"memory_limit": ID_CHECK_MEMORY, "temp_directory": spill,
                                            "preserve_insertion_order": False, "autoload_known_extensions": False,
                                            "autoinstall_known_extensions": False})
        try:
            nulls = cast("tuple[Any, ...]", connection.execute(  # an aggregate: always one row
                f"SELECT count(*) FILTER (WHERE {column} IS NULL) FROM read_parquet(?)", [str(path)]).fetchone())[0]
            if nulls:
                raise UserError(f"id_column {spec.id_column!r} has {nulls} null values", where=where, hint="every row needs an id")
            duplicate = connection.execute(
                f"SELECT CAST({column} AS VARCHAR), count(*) FROM read_parquet(?) GROUP BY {column} HAVING count(*) > 1 LIMIT 1",
                [str(path)]).fetchone()
        except duckdb.Error as exc:
            raise UserError(f"{str(spec.path)!r} is not a readable Parquet file: {str(exc).splitlines()[0]}", where=where) from None
        finally:
            connection.close()
    if duplicate is not None:
        raise UserError(f"id_column {spec.id_column!r} has duplicate values ({duplicate[0]!r} appears {duplicate[1]} times)",
                        where=where, hint="row ids must be unique")
