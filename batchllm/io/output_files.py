"""Output files, written by joins in DuckDB a window of input rows at a time (bounded memory
at any size: each query joins one window of the input with the journal segments whose rows
meet it, so neither a hash table nor a sort ever spans the data set):

- `<out>/nodes/<node>.parquet`: every committed (row, step) of a node, sorted by the row's
  position and step, with the row's id from the input;
- `<out>/<output>.parquet`: one row per input row, in input order: `row_id` and the
  columns an output names (input columns, node results, merges), null where a node has
  no final output for the row; `<out>/<output>.jsonl` (`format: jsonl`): the same rows as
  JSON lines, one object per row (keys in column order, null where the Parquet has null).

Each file is written beside its destination and renamed into place, so a reader (or a
crash) sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.core.files import replacing
from batchllm.core.result_schema import (
    CLASSIFY_FIELD_COLUMNS,
    LOGPROBS_FIELD,
    SCORE_FIELD,
    VECTOR_FIELD_NAME,
    result_schema,
    vector_field,
)
from batchllm.dag.model import ColumnRef, OutputSpec
from batchllm.io.input_source import ROW_ID
from batchllm.io.node_journal import ResultJournal
from batchllm.io.sql import sql_literal

MEMORY_LIMIT = "128MB"
DUCKDB_THREADS = 1  # two threads: ~+60 MB of DuckDB's allocator caches for a write that is a small part of a run
ROW_GROUP_ROWS = 65_536
JOIN_WINDOW_ROWS = 16_384  # input rows per join. Writing a 3-node data set alone: peak +0.17 GB at 1M rows, +0.19 GB at 10M
#                       (20 s); 32,768 rows on two threads: +0.29 GB (16 s); the whole data set at once: +0.51 GB at 10M
READ_BUFFER_BYTES = 1 << 20  # the input's pages stream through this buffer
JSON_SQL_TYPES = {"integer": "BIGINT", "number": "DOUBLE", "boolean": "BOOLEAN", "string": "VARCHAR", "json": "VARCHAR"}
LOGPROBS_SQL_TYPE = "STRUCT(token VARCHAR, logprob DOUBLE, top_logprobs STRUCT(token VARCHAR, logprob DOUBLE)[])[]"
ARROW_TYPES = {"BIGINT": pa.int64(), "DOUBLE": pa.float64(), "BOOLEAN": pa.bool_(), "VARCHAR": pa.string(),
               LOGPROBS_SQL_TYPE: LOGPROBS_FIELD[1]}
NODE_SCHEMA = result_schema((ROW_ID, pa.string()))  # a node file's columns (with `texts` when n > 1)
NODE_COLUMNS = tuple(NODE_SCHEMA.names[1:])


@dataclass(frozen=True)
class FinalSource:
    """Which record of a node is a row's final output."""

    journal: ResultJournal
    last_step_column: str | None  # None: step 0; else the input's list column whose length - 1 is the last step


@dataclass(frozen=True)
class InputFile:
    path: Path
    id_column: str | None


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _connect(spill_dir: Path) -> duckdb.DuckDBPyConnection:
    connection = duckdb.connect(config={"memory_limit": MEMORY_LIMIT, "threads": DUCKDB_THREADS, "preserve_insertion_order": True})
    connection.execute(f"SET temp_directory = {sql_literal(str(spill_dir))}")
    connection.execute("SET enable_progress_bar = false")  # else DuckDB draws one on the terminal after 2 s
    return connection


def _column_type(ref: ColumnRef, vector_dimensions: int | None) -> tuple[str, pa.DataType]:
    """The SQL and Arrow types of a node result's column: a result field's, or a JSON field's."""
    if ref.json_type is not None:
        kind = JSON_SQL_TYPES[ref.json_type]
    elif CLASSIFY_FIELD_COLUMNS.get(ref.field, ref.field) == VECTOR_FIELD_NAME and vector_dimensions is not None:
        return f"FLOAT[{vector_dimensions}]", vector_field(vector_dimensions)[1]
    else:
        kind = {"text": "VARCHAR", "label": "VARCHAR", "finish_reason": "VARCHAR", "logprobs": LOGPROBS_SQL_TYPE, "logprob": "DOUBLE",
                SCORE_FIELD[0]: "DOUBLE"}.get(ref.field, "BIGINT")
    return kind, ARROW_TYPES[kind]


def _result_value(alias: str, ref: ColumnRef) -> str:
    """A result field, or a JSON-schema output's property read from its text: null where the
    text is not JSON (e.g. cut at max_tokens) or the value does not have the property's type."""
    if ref.field == "logprob":  # the sum over the output's tokens
        return f"list_sum(list_transform({alias}.logprobs, lambda t: t.logprob))"
    if ref.json_type is None:
        return f"{alias}.{CLASSIFY_FIELD_COLUMNS.get(ref.field, ref.field)}"
    path = sql_literal(f'$."{ref.field}"')
    value = (f"json_extract({alias}.text, {path})::VARCHAR" if ref.json_type == "json"
             else f"TRY_CAST(json_extract_string({alias}.text, {path}) AS {JSON_SQL_TYPES[ref.json_type]})")
    return f"CASE WHEN json_valid({alias}.text) THEN {value} END"


def _row_id(input_alias: str, source: InputFile) -> str:
    if source.id_column:
        return f"CAST({input_alias}.{_quote(source.id_column)} AS VARCHAR)"
    return f"CAST({input_alias}.file_row_number AS VARCHAR)"


@dataclass(frozen=True)
class _Segments:
    """A journal's compacted segments and the row range of each (from Parquet statistics)."""

    paths: tuple[Path, ...]
    ranges: tuple[tuple[int, int], ...]  # (first row, last row) of each

    @classmethod
    def of(cls, journal: ResultJournal) -> _Segments:
        paths = tuple(journal.segment_paths())
        return cls(paths, tuple(_row_range(p) for p in paths))

    def sql(self, start: int, stop: int) -> str:
        """Its records of rows [start, stop) as a table expression (typed and empty if none)."""
        meeting = [p for p, (first, last) in zip(self.paths, self.ranges) if first < stop and last >= start]
        if not meeting:
            return ("(SELECT NULL::BIGINT AS row, NULL::INTEGER AS step, NULL::VARCHAR AS text, NULL::BIGINT AS "
                    "num_prompt_tokens, NULL::BIGINT AS num_output_tokens, NULL::VARCHAR AS finish_reason, "
                    f"NULL::VARCHAR[] AS texts, NULL::{LOGPROBS_SQL_TYPE} AS logprobs, NULL::FLOAT[] AS vector, "
                    "NULL::DOUBLE AS score WHERE false)")
        files = ", ".join(sql_literal(str(p)) for p in meeting)
        return f"(SELECT * FROM read_parquet([{files}]) WHERE row >= {int(start)} AND row < {int(stop)})"


def _row_range(path: Path) -> tuple[int, int]:
    metadata = pq.read_metadata(path)
    column = metadata.schema.to_arrow_schema().get_field_index("row")
    stats = [metadata.row_group(g).column(column).statistics for g in range(metadata.num_row_groups)]
    return min(int(s.min) for s in stats), max(int(s.max) for s in stats)


def _input_windows(source: InputFile, columns: list[str]) -> Iterator[tuple[int, pa.Table]]:
    """(first row, table) per window of the input: `columns` and `file_row_number` (the position)."""
    with pq.ParquetFile(source.path, pre_buffer=False, buffer_size=READ_BUFFER_BYTES) as handle:
        rows = handle.metadata.num_rows
        if not columns:
            for start in range(0, rows, JOIN_WINDOW_ROWS):
                yield start, pa.table({"file_row_number": np.arange(start, min(rows, start + JOIN_WINDOW_ROWS), dtype=np.int64)})
            return
        start = 0
        for batch in handle.iter_batches(batch_size=JOIN_WINDOW_ROWS, columns=columns, use_threads=False):
            positions = pa.array(np.arange(start, start + batch.num_rows, dtype=np.int64))
            yield start, pa.Table.from_batches([batch]).append_column("file_row_number", positions)
            start += batch.num_rows


def _windows_sql(connection: duckdb.DuckDBPyConnection, source: InputFile, columns: list[str],
                 query_of: Callable[[int, int], str]) -> Iterator[pa.RecordBatch]:
    """Each window's rows of `query_of(start, stop)` (which reads the window as `input_window`)."""
    for start, window in _input_windows(source, columns):
        connection.register("input_window", window)
        try:
            yield from connection.sql(query_of(start, start + window.num_rows)).to_arrow_reader(ROW_GROUP_ROWS)
        finally:
            connection.unregister("input_window")


def _copy_windows(source: InputFile, columns: list[str], query_of: Callable[[int, int], str] | None, path: Path,
                  schema: pa.Schema, dictionary: list[str]) -> None:
    """The windows' rows (none if `query_of` is None) into `path`, atomically, with exactly
    `schema`'s types (DuckDB's own COPY marks a column `not null` when the data happens to
    have no null, and names list items `element`); DuckDB spills beside it if it must,
    Python holds one window of the input and one batch. zstd, dictionary pages only for
    `dictionary` (few distinct values): at 10M short results 22 MB in 2.4 s against 127 MB
    in 2.6 s with pyarrow's defaults."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as new, tempfile.TemporaryDirectory(dir=path.parent, prefix=".spill-") as spill:
        with pq.ParquetWriter(new.path, schema, compression="zstd", use_dictionary=dictionary) as writer:
            if query_of is not None:
                connection = _connect(Path(spill))
                try:
                    for batch in _windows_sql(connection, source, columns, query_of):
                        writer.write_batch(batch.cast(schema))
                finally:
                    connection.close()


def _copy_windows_jsonl(source: InputFile, columns: list[str], query_of: Callable[[int, int], str], path: Path) -> None:
    """The windows' rows into `path` as JSON lines, atomically: each window by DuckDB's COPY
    into the spill folder, appended in order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as new, tempfile.TemporaryDirectory(dir=path.parent, prefix=".spill-") as spill, \
            open(new.path, "wb") as out:
        connection = _connect(Path(spill))
        part = Path(spill) / "window.jsonl"
        try:
            for start, window in _input_windows(source, columns):
                connection.register("input_window", window)
                try:
                    query = query_of(start, start + window.num_rows)
                    connection.execute(f"COPY ({query}) TO {sql_literal(str(part))} (FORMAT json)")
                finally:
                    connection.unregister("input_window")
                with open(part, "rb") as lines:
                    shutil.copyfileobj(lines, out)
        finally:
            connection.close()


def write_node_file(journal: ResultJournal, source: InputFile, path: Path) -> None:
    """Every committed result of the node (the journal's tail is compacted first)."""
    journal.compact()
    schema = result_schema((ROW_ID, pa.string()), journal.samples, journal.logprobs, journal.vector_dimensions, journal.scores_kept)
    segments = _Segments.of(journal)
    id_columns = [source.id_column] if source.id_column else []
    if not segments.paths:
        _copy_windows(source, id_columns, None, path, schema, ["finish_reason"])
        return
    extra = ((", s.texts" if journal.samples > 1 else "") + (", s.logprobs" if journal.logprobs else "")
             + (", s.vector" if journal.vector_dimensions is not None else "") + (", s.score" if journal.scores_kept else ""))
    columns = ", ".join(f"s.{c}" for c in NODE_COLUMNS)

    def query_of(start: int, stop: int) -> str:
        return (f"SELECT {_row_id('i', source)} AS {ROW_ID}, {columns}{extra} FROM {segments.sql(start, stop)} s "
                f"JOIN input_window i ON i.file_row_number = s.row ORDER BY s.row, s.step")

    _copy_windows(source, id_columns, query_of, path, schema, ["finish_reason"])


def write_output_set(spec: OutputSpec, source: InputFile, finals: dict[str, FinalSource],
                     merges: dict[str, tuple[str, ...]], path: Path) -> None:
    """One row per input row: `row_id` and the spec's columns, in input order."""
    for final in finals.values():
        final.journal.compact()
    nodes = sorted({member for ref in spec.columns.values() if ref.node
                    for member in merges.get(ref.node, (ref.node,))})
    selects = [f"{_row_id('i', source)} AS {ROW_ID}"]
    input_schema, fields = pq.read_schema(source.path), [pa.field(ROW_ID, pa.string())]
    aliases = {node: f"n{k}" for k, node in enumerate(nodes)}
    segments = {node: _Segments.of(finals[node].journal) for node in nodes}
    steps = {node: (f"len(i.{_quote(cast(str, finals[node].last_step_column))}) - 1" if finals[node].last_step_column else "0")
             for node in nodes}
    read = {c for c in [source.id_column, *(finals[n].last_step_column for n in nodes)] if c}
    for name, ref in spec.columns.items():
        if ref.node is None:
            read.add(ref.field)
            selects.append(f"i.{_quote(ref.field)} AS {_quote(name)}")
            fields.append(pa.field(name, input_schema.field(ref.field).type))
            continue
        members = merges.get(ref.node, (ref.node,))
        kind, arrow_type = _column_type(ref, finals[members[0]].journal.vector_dimensions)
        cases = " ".join(f"WHEN {aliases[m]}.row IS NOT NULL THEN {_result_value(aliases[m], ref)}" for m in members)
        selects.append(f"CAST(CASE {cases} END AS {kind}) AS {_quote(name)}")
        fields.append(pa.field(name, arrow_type))
    columns = [c for c in input_schema.names if c in read]

    def query_of(start: int, stop: int) -> str:
        joins = " ".join(f"LEFT JOIN {segments[n].sql(start, stop)} {aliases[n]} ON {aliases[n]}.row = i.file_row_number "
                         f"AND {aliases[n]}.step = {steps[n]}" for n in nodes)
        return f"SELECT {', '.join(selects)} FROM input_window i {joins} ORDER BY i.file_row_number"

    if spec.format == "jsonl":
        _copy_windows_jsonl(source, columns, query_of, path)
        return
    reasons = [name for name, ref in spec.columns.items() if ref.node and ref.field == "finish_reason"]
    _copy_windows(source, columns, query_of, path, pa.schema(fields), reasons)
