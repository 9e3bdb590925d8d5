"""Streaming conversion of an input's files (JSONL, CSV, a Hugging Face `save_to_disk`
folder, several Parquet files) into one Parquet file, rows in the files' order.

Invariant: memory is bounded whatever the source's size: DuckDB reads JSONL and CSV under
`MEMORY_LIMIT` (spilling to a temporary folder of the system's), Arrow files are read one
record batch at a time, and the writer holds at most one row group (`ROW_GROUP_ROWS` rows
or `ROW_GROUP_BYTES`). Every problem with the source is a UserError naming the user's file,
and for JSONL and CSV the physical line: when DuckDB refuses a file, a second pass in Python
finds the first bad line (DuckDB's own line numbers count records, not lines). Types: JSONL
keeps JSON's (numbers, strings, lists, objects); CSV has none, so every column is text.
"""

from __future__ import annotations

import csv
import gzip
import json
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.core.errors import UserError

MEMORY_LIMIT = "512MB"
BATCH_ROWS = 8_192
ROW_GROUP_ROWS = 65_536
ROW_GROUP_BYTES = 64 << 20
READ_BUFFER_BYTES = 1 << 20
NOT_TEXT = "is not UTF-8 text"
HINTS = {"jsonl": "each line of a JSONL file holds one JSON object (blank lines are skipped)",
         "csv": "a CSV file has a header line, then lines of as many fields, a field holding the delimiter, "
                "a quote or a line break in double quotes (\"\" for a quote)"}


@dataclass(frozen=True)
class InputFiles:
    """The files an input's rows come from, in row order, and their format."""

    format: str  # parquet | jsonl | csv | hf
    files: tuple[Path, ...]
    shown: str  # the path as the user gave it (resolved), for messages
    where: str  # `inputs.<name>`, for messages


def convert(source: InputFiles, target: Path) -> None:
    """Write every row of `source` into the Parquet file `target` (created or replaced)."""
    if source.format in ("jsonl", "csv"):
        _convert_with_duckdb(source, target)
    else:
        _convert_arrow(source, target)


# -- writing ---------------------------------------------------------------------------------
def _plain_type(kind: pa.DataType) -> pa.DataType:
    """Nullable fields, list items named `item` (as pyarrow writes them), recursively."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        make = pa.list_ if pa.types.is_list(kind) else pa.large_list
        return make(pa.field("item", _plain_type(kind.value_type)))
    if pa.types.is_struct(kind):
        return pa.struct([pa.field(f.name, _plain_type(f.type)) for f in kind])
    return kind


def _plain_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema([pa.field(f.name, _plain_type(f.type)) for f in schema])


class _RowGroupWriter:
    """Batches in, row groups of ~ROW_GROUP_ROWS rows out; holds one row group at most."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.schema = _plain_schema(schema)
        self._writer = pq.ParquetWriter(path, self.schema)
        self._pending: list[pa.RecordBatch] = []
        self._rows = self._bytes = 0

    def write(self, batch: pa.RecordBatch) -> None:
        self._pending.append(batch.cast(self.schema))
        self._rows += batch.num_rows
        self._bytes += batch.nbytes
        if self._rows >= ROW_GROUP_ROWS or self._bytes >= ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            table = pa.Table.from_batches(self._pending, self.schema)
            self._writer.write_table(table, row_group_size=table.num_rows)
        self._pending, self._rows, self._bytes = [], 0, 0

    def close(self) -> None:
        self._flush()
        self._writer.close()


# -- JSONL and CSV, read by DuckDB -------------------------------------------------------------
def _convert_with_duckdb(source: InputFiles, target: Path) -> None:
    names = [str(f) for f in source.files]
    union = ", union_by_name = true" if len(names) > 1 else ""
    if source.format == "jsonl":
        relation = f"read_json(?, format = 'newline_delimited', records = true, sample_size = -1{union})"
    else:
        delimiter = "\t" if any(_stem_suffix(f) == ".tsv" for f in source.files) else ","
        relation = (f"read_csv(?, header = true, skip = 0, comment = '', delim = '{delimiter}', quote = '\"', "
                    f"escape = '\"', strict_mode = true, all_varchar = true{union})")
    with tempfile.TemporaryDirectory(prefix="batchllm-convert-") as spill:
        connection = duckdb.connect(config={"memory_limit": MEMORY_LIMIT, "temp_directory": spill, "threads": 2,
                                            "preserve_insertion_order": True, "autoload_known_extensions": False,
                                            "autoinstall_known_extensions": False})
        try:
            connection.execute("SET enable_progress_bar = false")
            reader = connection.sql(f"SELECT * FROM {relation}", params=[names]).to_arrow_reader(BATCH_ROWS)
            writer = _RowGroupWriter(target, reader.schema)
            try:
                for batch in reader:
                    writer.write(batch)
            finally:
                writer.close()
        except duckdb.Error as exc:
            _diagnose(source, str(exc).strip().splitlines()[0])
        finally:
            connection.close()


def _diagnose(source: InputFiles, refusal: str) -> None:
    """DuckDB refused the files: raise the first bad line's error, else DuckDB's own words."""
    finder = _bad_json_line if source.format == "jsonl" else _bad_csv_line
    kind = "JSONL" if source.format == "jsonl" else "CSV"
    records = 0
    for file in source.files:
        count, bad = finder(file)
        records += count
        if bad is not None:
            line, reason = bad
            hint = "save the file as UTF-8" if reason == NOT_TEXT else HINTS[source.format]
            raise UserError(f"{str(file)!r}, line {line}: {reason}", where=source.where, hint=hint)
    if not records:
        raise UserError(f"input file {source.shown!r} has no rows", where=source.where,
                        hint="point `path:` at a data set with at least one row")
    raise UserError(f"{source.shown!r} is not a readable {kind} input: {refusal}", where=source.where)


def _stem_suffix(path: Path) -> str:
    """The extension that names the format: `.jsonl` for `a.jsonl` and `a.jsonl.gz`."""
    suffixes = [s.lower() for s in path.suffixes]
    return suffixes[-2] if len(suffixes) >= 2 and suffixes[-1] == ".gz" else (suffixes[-1] if suffixes else "")


def _open_binary(path: Path) -> gzip.GzipFile | BufferedReader:
    return gzip.open(path, "rb") if path.suffix.lower() == ".gz" else open(path, "rb")


def _bad_json_line(path: Path) -> tuple[int, tuple[int, str] | None]:
    """(records before the first bad line, (line, why) of that line or None), one line at a time."""
    records = 0
    with _open_binary(path) as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw)
            except UnicodeDecodeError:
                return records, (number, NOT_TEXT)
            except json.JSONDecodeError as exc:
                return records, (number, f"is not valid JSON ({exc.msg} at column {exc.colno})")
            if not isinstance(value, dict):
                return records, (number, f"is a JSON {type(value).__name__}, not an object")
            records += 1
    return records, None


class _NotText(Exception):
    def __init__(self, line: int):
        self.line = line


def _decoded(handle: Iterable[bytes], counter: list[int]) -> Iterator[str]:
    for raw in handle:
        counter[0] += 1
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _NotText(counter[0]) from None


def _bad_csv_line(path: Path) -> tuple[int, tuple[int, str] | None]:
    """(records before the first bad line, (line, why) or None); a record may span lines."""
    delimiter = "\t" if _stem_suffix(path) == ".tsv" else ","
    records, width, start, counter = 0, None, 1, [0]
    with _open_binary(path) as handle:
        reader = csv.reader(_decoded(handle, counter), delimiter=delimiter, quotechar='"', doublequote=True, strict=True)
        try:
            for record in reader:
                if record:
                    if width is None:
                        width = len(record)
                    elif len(record) != width:
                        return records, (start, f"has {len(record)} fields, the header has {width}")
                    else:
                        records += 1
                start = counter[0] + 1
        except csv.Error as exc:
            return records, (start, f"is not valid CSV ({exc})")
        except _NotText as bad:
            return records, (bad.line, NOT_TEXT)
    return records, None


# -- Parquet files and Arrow IPC files (Hugging Face), read by Arrow ------------------------------
def _parquet_schema(path: Path) -> pa.Schema:
    return pq.read_schema(path)


def _parquet_batches(path: Path) -> Iterator[pa.RecordBatch]:
    with pq.ParquetFile(path, pre_buffer=False, buffer_size=READ_BUFFER_BYTES) as handle:
        yield from handle.iter_batches(batch_size=BATCH_ROWS, use_threads=False)


def _ipc_reader(handle: pa.NativeFile) -> pa.ipc.RecordBatchStreamReader | pa.ipc.RecordBatchFileReader:
    """`save_to_disk` writes Arrow IPC streams; the IPC file format is read as well."""
    try:
        return pa.ipc.open_stream(handle)
    except pa.ArrowInvalid:
        handle.seek(0)
        return pa.ipc.open_file(handle)


def _ipc_schema(path: Path) -> pa.Schema:
    with pa.OSFile(str(path)) as handle:
        return _ipc_reader(handle).schema


def _ipc_batches(path: Path) -> Iterator[pa.RecordBatch]:
    with pa.OSFile(str(path)) as handle:
        reader = _ipc_reader(handle)
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            yield from (reader.get_batch(k) for k in range(reader.num_record_batches))
        else:
            yield from reader


ARROW_READERS = {"parquet": ("Parquet", _parquet_schema, _parquet_batches),
                 "hf": ("Arrow (Hugging Face datasets)", _ipc_schema, _ipc_batches)}


def _convert_arrow(source: InputFiles, target: Path) -> None:
    """Every file's schema first (footers only), unified; then the rows, file after file."""
    kind, read_schema, read_batches = ARROW_READERS[source.format]
    schemas = []
    for file in source.files:
        try:
            schemas.append(read_schema(file).remove_metadata())
        except (pa.ArrowException, OSError) as exc:
            raise UserError(f"{str(file)!r} is not a readable {kind} file: {exc}", where=source.where) from None
    schema = _unified(source, schemas)
    writer = _RowGroupWriter(target, schema)
    try:
        for file in source.files:
            try:
                for batch in read_batches(file):
                    writer.write(batch.select(schema.names))
            except (pa.ArrowException, OSError) as exc:
                raise UserError(f"{str(file)!r} is not a readable {kind} file: {exc}", where=source.where) from None
    finally:
        writer.close()


def _unified(source: InputFiles, schemas: list[pa.Schema]) -> pa.Schema:
    """One schema for every file, in the first file's column order: the same columns, types
    widened where Arrow can (an int32 and an int64 column are int64)."""
    first, merged = source.files[0], schemas[0]
    for file, schema in zip(source.files[1:], schemas[1:]):
        if sorted(schema.names) != sorted(merged.names):
            raise UserError(f"{str(file)!r} has columns {', '.join(schema.names)}, but {str(first)!r} has "
                            f"{', '.join(merged.names)}", where=source.where, hint="every file of an input needs the same columns")
        try:
            merged = pa.unify_schemas([merged, schema], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            raise UserError(f"the column types of {str(file)!r} do not match those of {str(first)!r}: {exc}",
                            where=source.where, hint="every file of an input needs the same column types") from None
    return merged
