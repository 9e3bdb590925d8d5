"""Input data sets: Parquet files with a stable string `row_id` per row."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchllm.errors import UserError
from batchllm.dag.model import InputSpec

from batchllm.io.input_source import ROW_ID  # one definition, shared with the windowed reader


@dataclass(frozen=True)
class InputTable:
    spec: InputSpec
    table: pa.Table  # the file's columns plus `row_id` (string, unique)

    def rows_by_id(self) -> dict[str, dict]:
        return {row[ROW_ID]: row for row in self.table.to_pylist()}


def load_input(spec: InputSpec) -> InputTable:
    where = f"inputs.{spec.name}"
    if not spec.path.is_file():
        raise UserError(f"input file {str(spec.path)!r} does not exist", where=where, hint="fix `path:` (relative paths start at the DAG file's folder)")
    try:
        table = pq.read_table(spec.path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise UserError(f"{str(spec.path)!r} is not a readable Parquet file: {exc}", where=where) from None
    if table.num_rows == 0:
        raise UserError(f"input file {str(spec.path)!r} has no rows", where=where, hint="point `path:` at a data set with at least one row")
    if ROW_ID in table.column_names and spec.id_column != ROW_ID:
        raise UserError(f"input file has a column named {ROW_ID!r}, which batchllm reserves", where=where,
                        hint=f"set `id_column: {ROW_ID}` to use it as the row id, or rename it")
    if spec.id_column is None:
        ids = pa.array([str(i) for i in range(table.num_rows)], pa.string())
    else:
        if spec.id_column not in table.column_names:
            raise UserError(f"id_column {spec.id_column!r} is not a column of {str(spec.path)!r}", where=where,
                            hint=f"columns: {', '.join(table.column_names)}")
        column = table.column(spec.id_column)
        if column.null_count:
            raise UserError(f"id_column {spec.id_column!r} has {column.null_count} null values", where=where, hint="every row needs an id")
        ids = pc.cast(column, pa.string()).combine_chunks()
        if len(pc.unique(ids)) != len(ids):
            raise UserError(f"id_column {spec.id_column!r} has duplicate values", where=where, hint="row ids must be unique")
        if spec.id_column == ROW_ID:
            table = table.drop_columns([ROW_ID])
    return InputTable(spec=spec, table=table.append_column(ROW_ID, ids))


def load_inputs(specs: dict[str, InputSpec]) -> dict[str, InputTable]:
    return {name: load_input(spec) for name, spec in specs.items()}
