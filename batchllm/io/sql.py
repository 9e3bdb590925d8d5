"""Routing predicates (`where:`), evaluated by DuckDB with no file or network access."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from batchllm.core.errors import UserError
from batchllm.io.input_source import ROW_ID, InputSource


def sql_literal(text: str | Path) -> str:
    """A SQL string literal: `text` in single quotes, its quotes doubled."""
    return "'" + str(text).replace("'", "''") + "'"


def predicate_failed(predicate: str, exc: duckdb.Error, where: str) -> UserError:
    """The error for a `where:` predicate DuckDB refused, quoting it and DuckDB's first line."""
    first_line = str(exc).strip().splitlines()[0]
    return UserError(f"the SQL predicate {predicate!r} failed in DuckDB: {first_line}", where=where,
                     hint="write a boolean SQL expression over input columns and upstream node names")


class WhereFilter:
    """A `where:` predicate evaluated batch after batch on one DuckDB connection, opened at
    the first batch (opening one costs ~20 ms of CPU: once per batch, it was a fifth of the
    driver's time in a routed node's run; a reused one ~1.5 ms a batch)."""

    def __init__(self, predicate: str, *, where: str):
        self.predicate, self.where = predicate, where
        self._connection: duckdb.DuckDBPyConnection | None = None

    def kept(self, rows: pa.Table, upstream: dict[str, pa.Array], key: str = ROW_ID) -> pa.Array:
        """The `key` column's values of the rows of `rows` for which the predicate holds.

        `upstream` maps node names to their text outputs, aligned with `rows`; the
        predicate sees them as columns next to the input columns.
        """
        table = rows
        for name, column in upstream.items():
            table = table.append_column(name, column)
        if self._connection is None:
            self._connection = duckdb.connect(config={"enable_external_access": False, "threads": 1})  # small batches
        self._connection.register("batch_rows", table)
        try:
            result = self._connection.sql(f"SELECT {key} FROM batch_rows WHERE ({self.predicate})").to_arrow_table()
        except duckdb.Error as exc:
            raise predicate_failed(self.predicate, exc, self.where) from None
        finally:
            self._connection.unregister("batch_rows")
        return result.column(0).combine_chunks()

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def where_row_ids(rows: pa.Table, upstream: dict[str, pa.Array], predicate: str, *, where: str,
                  key: str = ROW_ID) -> list:
    """`WhereFilter.kept` once, as a list."""
    check = WhereFilter(predicate, where=where)
    try:
        return check.kept(rows, upstream, key).to_pylist()
    finally:
        check.close()


def rows_where(source: InputSource, predicate: str, *, where: str, sample_rows: int) -> tuple[int, pa.Table]:
    """How many rows of an input `predicate` (over its columns only) keeps, and the first
    `sample_rows` of them as templates see rows (with `row_id`; by position it is known only
    for an id column, else empty). One streaming DuckDB scan of the file; no row is held."""
    connection = duckdb.connect(config={"enable_external_access": False, "threads": 2})
    try:
        connection.register("input_rows", ds.dataset(source.path, format="parquet"))
        count = connection.sql(f"SELECT count(*) FROM input_rows WHERE ({predicate})").fetchall()[0][0]
        sample = connection.sql(f"SELECT * FROM input_rows WHERE ({predicate}) LIMIT {int(sample_rows)}").to_arrow_table()
    except duckdb.Error as exc:
        raise predicate_failed(predicate, exc, where) from None
    finally:
        connection.close()
    if ROW_ID in sample.column_names:
        sample = sample.drop_columns([ROW_ID])
    ids = (pc.cast(sample.column(source.id_column), pa.string()) if source.id_column
           else pa.array([""] * sample.num_rows, pa.string()))
    return count, sample.append_column(pa.field(ROW_ID, pa.string()), ids)
