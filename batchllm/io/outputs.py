"""Parquet outputs: per-node results and the DAG's final data sets, written atomically.

A file is written beside its destination and renamed into place, so a reader (or a
crash) sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.io.inputs import ROW_ID, InputTable
from batchllm.io.journal import ResultRecord
from batchllm.dag.model import OutputSpec

NODE_SCHEMA = pa.schema([
    (ROW_ID, pa.string()),
    ("step", pa.int32()),
    ("text", pa.string()),
    ("num_prompt_tokens", pa.int64()),
    ("num_output_tokens", pa.int64()),
    ("finish_reason", pa.string()),
])


def write_parquet_atomically(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def node_table(records: list[ResultRecord], samples: int) -> pa.Table:
    ordered = sorted(records, key=lambda r: (r.row_id, r.step))
    columns = {
        ROW_ID: [r.row_id for r in ordered],
        "step": [r.step for r in ordered],
        "text": [r.text for r in ordered],
        "num_prompt_tokens": [r.num_prompt_tokens for r in ordered],
        "num_output_tokens": [r.num_output_tokens for r in ordered],
        "finish_reason": [r.finish_reason for r in ordered],
    }
    table = pa.table(columns, schema=NODE_SCHEMA)
    if samples > 1:
        table = table.append_column("texts", pa.array([list(r.texts) for r in ordered], pa.list_(pa.string())))
    return table


def output_table(spec: OutputSpec, data: InputTable, final_records: dict[str, dict[str, ResultRecord]]) -> pa.Table:
    """One row per input row; node columns are null where the node did not run on the row.

    `final_records` maps node -> row_id -> the record of the row's last step.
    """
    row_ids = data.table.column(ROW_ID).to_pylist()
    columns: dict[str, pa.Array] = {ROW_ID: pa.array(row_ids, pa.string())}
    for name, ref in spec.columns.items():
        if ref.node is None:
            columns[name] = data.table.column(ref.field)
            continue
        by_row = final_records.get(ref.node, {})
        kind = pa.string() if ref.field in ("text", "finish_reason") else pa.int64()
        values = [getattr(by_row[r], ref.field) if r in by_row else None for r in row_ids]
        columns[name] = pa.array(values, kind)
    return pa.table(columns)


def write_output_sets(outputs: dict[str, OutputSpec], tables: dict[str, InputTable],
                      final_records: dict[str, dict[str, ResultRecord]], path_for: Callable[[str], Path]) -> dict[str, Path]:
    """Every final data set of a DAG, each written atomically; name -> path."""
    written = {}
    for name, spec in outputs.items():
        written[name] = path_for(name)
        write_parquet_atomically(output_table(spec, tables[spec.input_name], final_records), written[name])
    return written
