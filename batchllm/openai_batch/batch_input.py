"""An OpenAI batch request file -> two Parquet files in the run folder, converted once.

- `requests.parquet`, the DAG's input: one row per request of a line that can run
  (request_id, custom_id, model, kind, system, prompt, messages, node, pair, images), in file order
  (sampling is per node: see groups). A chat or completion line is one request, its id the
  custom_id; a pooling line one per input or pair, `custom_id<US>k` (request_lines.ITEM_SEPARATOR);
- `lines.parquet`: one row per non-blank line (line, custom_id, model, kind, node,
  error_code, error_message, items, top_n), what the results file is written from.

A repeated custom_id keeps its first line; the later ones get `duplicate_custom_id`.
Invariant: the folder is `<state>/<digest>/`, the digest covering the request file's bytes,
the model mapping and `CONVERTER_VERSION`; it appears whole (built beside it and renamed)
and is reused as it is, so re-running the same command reads the same input file and
resumes. Lines are read in batches and duplicates found in DuckDB under a memory limit:
nothing is held per line of the file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from batchllm.core.errors import UserError
from batchllm.core.files import replacing
from batchllm.io.sql import sql_literal
from batchllm.openai_batch.batch_dag import BatchGroup, node_names
from batchllm.openai_batch.request_lines import ITEM_SEPARATOR, LineRecord, parse_line

CONVERTER_VERSION = 6
READ_BATCH_LINES = 8_192
MEMORY_LIMIT = "256MB"
GROUPS_FILE = "groups.json"  # written last: a folder with it is complete

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
ITEMS_TYPE = pa.list_(pa.struct([("text", pa.string()), ("pair", pa.string())]))
PARSED_SCHEMA = pa.schema([
    ("line", pa.int64()), ("custom_id", pa.string()), ("model", pa.string()), ("kind", pa.string()),
    ("system", pa.string()), ("prompt", pa.string()), ("messages", MESSAGES_TYPE), ("json_schema", pa.string()),
    ("group_key", pa.string()), ("error_code", pa.string()), ("error_message", pa.string()), ("items", ITEMS_TYPE),
    ("top_n", pa.int64()), ("images", pa.list_(pa.string()))])
REQUEST_SCHEMA = pa.schema([
    ("request_id", pa.string()), ("custom_id", pa.string()), ("model", pa.string()), ("kind", pa.string()), ("system", pa.string()),
    ("prompt", pa.string()), ("messages", MESSAGES_TYPE), ("node", pa.string()), ("pair", pa.string()),
    ("images", pa.list_(pa.string()))])
LINE_SCHEMA = pa.schema([
    ("line", pa.int64()), ("custom_id", pa.string()), ("model", pa.string()), ("kind", pa.string()),
    ("node", pa.string()), ("error_code", pa.string()), ("error_message", pa.string()), ("items", pa.int64()), ("top_n", pa.int64())])


@dataclass(frozen=True)
class BatchInput:
    folder: Path
    digest: str
    groups: tuple[BatchGroup, ...]
    lines: int  # non-blank lines
    runnable: int  # lines in requests.parquet

    @property
    def requests_path(self) -> Path:
        return self.folder / "requests.parquet"

    @property
    def lines_path(self) -> Path:
        return self.folder / "lines.parquet"


def prepare_batch(requests_file: Path, models: Mapping[str, str], state: Path) -> BatchInput:
    """The converted request file in `state/<digest>/`, made now or found there."""
    if not requests_file.is_file():
        raise UserError(f"request file {str(requests_file)!r} does not exist or is not a file", where="-i/--input")
    digest = _digest(requests_file, models)
    folder = state / digest[:32]
    if not (folder / GROUPS_FILE).is_file():
        with replacing(folder) as building:  # replaces an incomplete folder of an interrupted conversion
            (building.path / "spill").mkdir(parents=True)
            _build(requests_file, models, building.path)
            shutil.rmtree(building.path / "spill")
    saved = json.loads((folder / GROUPS_FILE).read_text())
    return BatchInput(folder, digest, tuple(BatchGroup(**g) for g in saved["groups"]), saved["lines"], saved["runnable"])


def _digest(requests_file: Path, models: Mapping[str, str]) -> str:
    hasher = hashlib.sha256(json.dumps([CONVERTER_VERSION, sorted(models.items())]).encode())
    with open(requests_file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()


def _records(requests_file: Path, models: Mapping[str, str]) -> Iterator[LineRecord]:
    with open(requests_file, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield LineRecord(number, None, None, None, None, None, None, error_code="invalid_json",
                                 error_message=f"line {number}: not UTF-8 text ({exc.reason} at byte {exc.start})")
                continue
            yield parse_line(text, number, models)


def _write_parsed(requests_file: Path, models: Mapping[str, str], path: Path) -> int:
    names = [f.name for f in fields(LineRecord)]
    lines = 0
    with pq.ParquetWriter(path, PARSED_SCHEMA) as writer:
        batch: list[LineRecord] = []
        for record in _records(requests_file, models):
            batch.append(record)
            if len(batch) == READ_BATCH_LINES:
                writer.write_table(_parsed_table(batch, names))
                lines += len(batch)
                batch = []
        if batch:
            writer.write_table(_parsed_table(batch, names))
            lines += len(batch)
    return lines


def _parsed_table(batch: list[LineRecord], names: list[str]) -> pa.Table:
    columns = {name: [getattr(r, name) for r in batch] for name in names if name in PARSED_SCHEMA.names}
    columns["messages"] = [None if r.messages is None else [{"role": role, "content": text} for role, text in r.messages]
                           for r in batch]
    columns["items"] = [None if r.items is None else [{"text": text, "pair": pair} for text, pair in r.items] for r in batch]
    columns["group_key"] = [r.group_key for r in batch]
    return pa.table(columns, schema=PARSED_SCHEMA)


def _build(requests_file: Path, models: Mapping[str, str], folder: Path) -> None:
    parsed = folder / "parsed.parquet"
    lines = _write_parsed(requests_file, models, parsed)
    connection = duckdb.connect(config={"memory_limit": MEMORY_LIMIT, "temp_directory": str(folder / "spill")})
    try:
        source = f"read_parquet({sql_literal(parsed)})"
        # Later lines of a custom_id (the first keeps its own outcome): few, so held here.
        dups = connection.sql(f"SELECT line, first_line FROM (SELECT line, min(line) OVER (PARTITION BY custom_id) AS first_line "
                              f"FROM {source} WHERE custom_id IS NOT NULL) WHERE line <> first_line").to_arrow_table()
        connection.register("dups", dups)
        keys = connection.sql(f"SELECT p.group_key, count(*) AS requests, min(p.line) AS first FROM {source} p "
                              f"LEFT JOIN dups d ON d.line = p.line WHERE p.error_code IS NULL AND d.line IS NULL "
                              f"GROUP BY p.group_key ORDER BY first").fetchall()
        decoded = [json.loads(key) for key, _, _ in keys]
        names = node_names([(d[0], d[2]) for d in decoded])
        groups = [BatchGroup(name, d[0], d[1], d[2], d[3], d[4], count, d[5], d[6]) for name, d, (_, count, _) in zip(names, decoded, keys)]
        connection.register("group_nodes", pa.table({"group_key": [k for k, _, _ in keys], "node": names},
                                                    schema=pa.schema([("group_key", pa.string()), ("node", pa.string())])))
        # a pooling line: one request per item, k from 0 (unnest keeps the list's order)
        items = (f"(SELECT *, unnest(range(len(items))) AS k FROM {source} WHERE items IS NOT NULL AND error_code IS NULL) p")
        kept = "JOIN group_nodes g ON g.group_key = p.group_key LEFT JOIN dups d ON d.line = p.line WHERE p.error_code IS NULL AND d.line IS NULL"
        _write_query(connection, f"""
            SELECT request_id, custom_id, model, kind, system, prompt, messages, node, pair, images FROM (
                SELECT p.line, 0 AS k, p.custom_id AS request_id, p.custom_id, p.model, p.kind, p.system, p.prompt, p.messages, g.node,
                       NULL AS pair, p.images
                FROM {source} p {kept} AND p.items IS NULL
                UNION ALL
                SELECT p.line, p.k, p.custom_id || chr({ord(ITEM_SEPARATOR)}) || p.k, p.custom_id, p.model, p.kind, NULL, struct_extract(p.items[p.k + 1], 'text'),
                       NULL, g.node, struct_extract(p.items[p.k + 1], 'pair'), NULL
                FROM {items} {kept})
            ORDER BY line, k""", folder / "requests.parquet", REQUEST_SCHEMA)
        _write_query(connection, f"""
            SELECT p.line, p.custom_id, p.model, p.kind, CASE WHEN d.line IS NULL THEN g.node END AS node,
                   CASE WHEN d.line IS NULL THEN p.error_code ELSE 'duplicate_custom_id' END AS error_code,
                   CASE WHEN d.line IS NULL THEN p.error_message ELSE 'line ' || p.line || ': custom_id '
                        || to_json(p.custom_id) || ' already appears on line ' || d.first_line END AS error_message,
                   len(p.items) AS items, p.top_n
            FROM {source} p LEFT JOIN dups d ON d.line = p.line LEFT JOIN group_nodes g ON g.group_key = p.group_key
            ORDER BY p.line""", folder / "lines.parquet", LINE_SCHEMA)
    finally:
        connection.close()
    parsed.unlink()
    runnable = sum(g.requests for g in groups)
    (folder / GROUPS_FILE).write_text(json.dumps({"lines": lines, "runnable": runnable, "groups": [asdict(g) for g in groups]}))


def _write_query(connection: duckdb.DuckDBPyConnection, query: str, path: Path, schema: pa.Schema) -> None:
    """The query's rows into a Parquet file with `schema`, batch by batch (the same rows give the same bytes)."""
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        for batch in connection.sql(query).to_arrow_reader(READ_BATCH_LINES):
            writer.write_batch(batch.cast(schema))

