"""InputSource: rows by position from Parquet row groups, in windows and sparse takes, validated on open."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import batchllm.io.parquet_blocks as blocks
from batchllm.core.errors import UserError
from batchllm.dag.model import InputSpec
from batchllm.io.input_source import ROW_ID, open_input, open_inputs

ROWS = 100
GROUP_ROWS = 7


def chunks_of(i: int) -> list[str] | None:
    return None if i % 5 == 0 else [f"c{i}.{k}" for k in range(i % 4)]


@pytest.fixture
def data(tmp_path):
    """100 rows in row groups of 7: windows and takes cross row-group borders."""
    table = pa.table({
        "id": [f"k{i}" for i in range(ROWS)],
        "n": list(range(1000, 1000 + ROWS)),
        "text": [f"text number {i}" for i in range(ROWS)],
        "chunks": pa.array([chunks_of(i) for i in range(ROWS)], pa.list_(pa.string())),
    })
    path = tmp_path / "data" / "rows.parquet"
    path.parent.mkdir()
    pq.write_table(table, path, row_group_size=GROUP_ROWS)
    assert pq.read_metadata(path).num_row_groups == 15
    return path, table


def spec(path, id_column=None):
    return InputSpec("rows", path, id_column, 3)


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of 3 rows inside row groups of 7 and a cache of one block: every read goes
    through cursors, forward and backward."""
    monkeypatch.setattr(blocks, "MIN_BLOCK_ROWS", 3)
    monkeypatch.setattr(blocks, "MAX_BLOCK_ROWS", 3)
    monkeypatch.setattr(blocks, "CACHE_BYTES", 0)


WINDOWS = [(0, ROWS), (5, 30), (6, 8), (7, 14), (13, 15), (40, 41), (98, 150), (30, 30), (20, 27), (0, 3)]


@pytest.mark.parametrize("small", [False, True])
def test_read_windows_across_row_groups(data, request, small):
    if small:
        request.getfixturevalue("tiny_blocks")
    path, table = data
    source = open_input(spec(path, "id"))
    assert source.num_rows == ROWS and source.schema.names == ["id", "n", "text", "chunks"]
    for start, stop in WINDOWS:  # forward and backward jumps, overlapping windows
        window = source.read(start, stop, ["text", "n"])
        assert window.column_names == ["text", "n"]
        assert window.num_rows == min(stop, ROWS) - start
        assert window.to_pylist() == table.select(["text", "n"]).slice(start, stop - start).to_pylist()


def test_consecutive_windows_read_each_block_once(data, tiny_blocks, monkeypatch):
    path, table = data
    source = open_input(spec(path))
    opened = []
    real_cursor = blocks._Cursor
    monkeypatch.setattr(blocks, "_Cursor", lambda *a: opened.append(a[2:4]) or real_cursor(*a))
    got = [source.read(start, start + 4, ["n"]).column("n").to_pylist() for start in range(0, ROWS, 4)]
    assert sum(got, []) == list(range(1000, 1000 + ROWS))
    assert opened == [(g, g * GROUP_ROWS) for g in range(15)]  # one cursor per row group, from its first row


@pytest.mark.parametrize("small", [False, True])
def test_take_sparse_sorted_rows(data, request, small):
    if small:
        request.getfixturevalue("tiny_blocks")
    path, table = data
    source = open_input(spec(path))
    for rows in ([0, 6, 7, 13, 14, 50, 99], [3, 3, 4], [99], list(range(0, ROWS, 9)), [60, 61, 62, 2]):
        rows = np.array(sorted(rows))
        assert source.take(rows, ["id", "chunks"]).to_pylist() == table.select(["id", "chunks"]).take(rows).to_pylist()
    assert source.take(np.array([], np.int64), ["id"]).num_rows == 0
    with pytest.raises(ValueError, match="sorted positions"):
        source.take(np.array([5, 2]), ["id"])
    with pytest.raises(ValueError, match="sorted positions"):
        source.take(np.array([ROWS]), ["id"])


def test_no_columns_still_counts_rows(data):
    source = open_input(spec(data[0]))
    assert source.read(10, 25, []).num_rows == 15
    assert source.take(np.array([1, 2, 50]), []).num_rows == 3


def test_unknown_column_is_a_programming_error(data):
    with pytest.raises(KeyError, match="no column 'nope'"):
        open_input(spec(data[0])).read(0, 5, ["nope"])


def test_returned_tables_are_compact_copies(data):
    source = open_input(spec(data[0]))
    window = source.read(2, 4, ["text"])
    assert window.column("text").chunk(0).offset == 0
    assert window.nbytes < 100  # two short strings, not the row group they came from


def test_head_and_head_rows(data):
    path, table = data
    source = open_input(spec(path, "id"))
    assert source.head(3).to_pylist() == table.slice(0, 3).to_pylist()
    assert source.head(1000).num_rows == ROWS
    rows = open_input(spec(path)).head_rows(2)
    assert rows.column_names == ["id", "n", "text", "chunks", ROW_ID]
    assert rows.schema.field(ROW_ID).type == pa.string()
    assert rows.column(ROW_ID).to_pylist() == ["0", "1"]
    assert source.head_rows(2).column(ROW_ID).to_pylist() == ["k0", "k1"]


def test_list_lengths(data):
    source = open_input(spec(data[0]))
    lengths = source.list_lengths("chunks")
    assert lengths.dtype == np.int32
    assert lengths.tolist() == [len(chunks_of(i) or []) for i in range(ROWS)]
    with pytest.raises(TypeError, match="not a list column"):
        source.list_lengths("text")


def test_row_ids_with_and_without_id_column(data):
    path, _ = data
    assert open_input(spec(path, "id")).row_ids(5, 9).to_pylist() == ["k5", "k6", "k7", "k8"]
    assert open_input(spec(path)).row_ids(97, 200).to_pylist() == ["97", "98", "99"]
    assert open_input(spec(path, "n")).row_ids(0, 2).to_pylist() == ["1000", "1001"]  # cast to string
    assert open_input(spec(path, "n")).row_ids(0, 2).type == pa.string()


def test_a_row_id_column_is_the_id_when_named(tmp_path):
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({ROW_ID: [7, 8], "text": ["a", "b"]}), path)
    source = open_input(spec(path, ROW_ID))
    assert source.schema.names == [ROW_ID, "text"]  # the file's columns, as they are
    assert source.head_rows(2).to_pylist() == [{"text": "a", ROW_ID: "7"}, {"text": "b", ROW_ID: "8"}]


def test_fingerprint_is_the_file_digest_and_id_column(data):
    path, table = data
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert open_input(spec(path, "id")).fingerprint() == digest + "id"
    assert open_input(spec(path)).fingerprint() == digest
    pq.write_table(table.slice(1), path, row_group_size=GROUP_ROWS)
    assert open_input(spec(path, "id")).fingerprint() != digest + "id"


def test_open_inputs_opens_each(data):
    sources = open_inputs({"a": spec(data[0]), "b": InputSpec("b", data[0], "id", 4)})
    assert {name: s.id_column for name, s in sources.items()} == {"a": None, "b": "id"}


# -- validation: exit-2 errors, nothing written -------------------------------------------------
def refused(path, id_column=None) -> UserError:
    folder = path.parent
    before = sorted(os.listdir(folder))
    with pytest.raises(UserError) as caught:
        open_input(spec(path, id_column))
    assert sorted(os.listdir(folder)) == before, "nothing may be written next to the data"
    assert caught.value.where == "inputs.rows"
    return caught.value


@pytest.fixture
def folder(tmp_path, monkeypatch):
    folder = tmp_path / "user"
    folder.mkdir()
    monkeypatch.chdir(folder)  # a spill into the working folder would show up too
    return folder


def test_missing_file(folder):
    error = refused(folder / "nope.parquet")
    assert error.message == f"input file {str(folder / 'nope.parquet')!r} does not exist"
    assert "relative paths start at the DAG file's folder" in error.hint


def test_unreadable_file(folder):
    (folder / "bad.parquet").write_text("not parquet at all")
    assert "is not a readable Parquet file" in refused(folder / "bad.parquet").message


def test_no_rows(folder):
    pq.write_table(pa.table({"id": pa.array([], pa.string())}), folder / "empty.parquet")
    assert refused(folder / "empty.parquet", "id").message.endswith("empty.parquet' has no rows")


def test_reserved_row_id_column(folder):
    pq.write_table(pa.table({ROW_ID: ["a"], "x": ["b"]}), folder / "r.parquet")
    error = refused(folder / "r.parquet")
    assert error.message == "input file has a column named 'row_id', which batchllm reserves"
    assert error.hint == "set `id_column: row_id` to use it as the row id, or rename it"


def test_id_column_missing(folder):
    pq.write_table(pa.table({"id": ["a"], "x": ["b"]}), folder / "m.parquet")
    error = refused(folder / "m.parquet", "key")
    assert error.message == f"id_column 'key' is not a column of {str(folder / 'm.parquet')!r}"
    assert error.hint == "columns: id, x"


def test_null_ids(folder):
    pq.write_table(pa.table({"id": ["a", None, "c", None]}), folder / "n.parquet", row_group_size=2)
    error = refused(folder / "n.parquet", "id")
    assert error.message == "id_column 'id' has 2 null values"
    assert error.hint == "every row needs an id"


def test_duplicate_ids_name_one(folder):
    pq.write_table(pa.table({"id": ["a", "b", "c", "b", "d"]}), folder / "d.parquet", row_group_size=2)
    error = refused(folder / "d.parquet", "id")
    assert error.message == "id_column 'id' has duplicate values ('b' appears 2 times)"
    assert error.hint == "row ids must be unique"


def test_duplicate_integer_ids(folder):
    pq.write_table(pa.table({"id": [1, 2, 3, 3, 3]}), folder / "i.parquet")
    assert refused(folder / "i.parquet", "id").message == "id_column 'id' has duplicate values ('3' appears 3 times)"


# -- scale -----------------------------------------------------------------------------------
def test_a_million_rows_are_read_in_windows_not_whole(tmp_path):
    rows = 1_000_000
    positions = pa.array(np.arange(rows))
    ids = pc.binary_join_element_wise("q", pc.cast(positions, pa.string()), "")
    table = pa.table({"id": ids, "prompt": pc.binary_join_element_wise("Tell me about item number ", ids, " please, in detail.", "")})
    decoded_bytes = table.nbytes
    path = tmp_path / "million.parquet"
    pq.write_table(table, path, row_group_size=100_000)
    del table, ids, positions

    source = open_input(spec(path, "id"))  # includes the duplicate check over a million ids
    assert source.num_rows == rows
    before = pa.total_allocated_bytes()
    window = source.read(500_000, 516_384, ["id", "prompt"])
    grown = pa.total_allocated_bytes() - before
    assert window.num_rows == 16_384
    assert window.column("id")[0].as_py() == "q500000" and window.column("id")[-1].as_py() == "q516383"
    assert window.column("prompt")[1].as_py() == "Tell me about item number q500001 please, in detail."
    assert source.row_ids(999_998, 1_000_000).to_pylist() == ["q999998", "q999999"]
    assert grown < decoded_bytes / 4, f"a window read grew Arrow memory by {grown:,} bytes of {decoded_bytes:,}"
