"""Node files and final data sets written from journals by DuckDB joins: contents, order,
types and row ids checked by hand on small inputs (segments and tail together)."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchllm.dag.model import ColumnRef, OutputSpec
from batchllm.io.journal_records import ResultRecord
from batchllm.io.node_journal import ResultJournal
from batchllm.io.output_files import NODE_SCHEMA, FinalSource, InputFile, write_node_file, write_output_set


@pytest.fixture
def input_path(tmp_path):
    """Four rows: an int id (cast to string in outputs), a question, and chunks to iterate over."""
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": pa.array([70, 71, 72, 73], pa.int64()),
                             "question": ["q0", "q1", "q2", "q3"],
                             "chunks": pa.array([["a", "b"], ["c"], None, ["d", "e", "f"]], pa.list_(pa.string()))}), path)
    return path


def result(row: int, step: int = 0, *texts: str, reason: str = "stop") -> ResultRecord:
    return ResultRecord(row, step, texts or (f"r{row}s{step}",), 100 + row, 10 * step + 1, reason)


def journal(tmp_path, name: str, records: list[ResultRecord], *, samples: int = 1, segment_records: int = 3) -> ResultJournal:
    opened = ResultJournal(tmp_path / "journal" / name, "fp", name, samples=samples, segment_records=segment_records)
    opened.append_many(records)
    return opened


def test_node_file_is_sorted_by_position_and_step_with_ids_from_the_id_column(tmp_path, input_path):
    # appended out of order; the first three go into a segment, the rest stay in the tail until the write
    chain = journal(tmp_path, "chain", [result(3, 1), result(0, 1), result(0, 0), result(3, 0),
                                         result(1, 0, reason="error: prompt too long")])
    write_node_file(chain, InputFile(input_path, "id"), tmp_path / "nodes" / "chain.parquet")
    table = pq.read_table(tmp_path / "nodes" / "chain.parquet")
    assert table.schema == NODE_SCHEMA
    assert table.to_pylist() == [
        {"row_id": "70", "step": 0, "text": "r0s0", "num_prompt_tokens": 100, "num_output_tokens": 1, "finish_reason": "stop"},
        {"row_id": "70", "step": 1, "text": "r0s1", "num_prompt_tokens": 100, "num_output_tokens": 11, "finish_reason": "stop"},
        {"row_id": "71", "step": 0, "text": "r1s0", "num_prompt_tokens": 101, "num_output_tokens": 1,
         "finish_reason": "error: prompt too long"},
        {"row_id": "73", "step": 0, "text": "r3s0", "num_prompt_tokens": 103, "num_output_tokens": 1, "finish_reason": "stop"},
        {"row_id": "73", "step": 1, "text": "r3s1", "num_prompt_tokens": 103, "num_output_tokens": 11, "finish_reason": "stop"},
    ]
    assert [p.name for p in (tmp_path / "nodes").iterdir()] == ["chain.parquet"]  # no temporary file left behind


def test_node_file_without_id_column_uses_positions_and_keeps_every_sample(tmp_path, input_path):
    sampled = journal(tmp_path, "sampled", [result(2, 0, "x", "y"), result(0, 0, "u", "v")], samples=2)
    write_node_file(sampled, InputFile(input_path, None), tmp_path / "sampled.parquet")
    table = pq.read_table(tmp_path / "sampled.parquet")
    assert table.schema == NODE_SCHEMA.append(pa.field("texts", pa.list_(pa.string())))
    assert table.column("row_id").to_pylist() == ["0", "2"]
    assert table.column("text").to_pylist() == ["u", "x"]
    assert table.column("texts").to_pylist() == [["u", "v"], ["x", "y"]]


def test_node_file_of_a_node_without_results_is_empty_with_its_columns(tmp_path, input_path):
    empty = journal(tmp_path, "empty", [])
    write_node_file(empty, InputFile(input_path, "id"), tmp_path / "empty.parquet")
    table = pq.read_table(tmp_path / "empty.parquet")
    assert table.num_rows == 0 and table.schema == NODE_SCHEMA


def test_output_set_has_one_row_per_input_row_with_final_outputs_and_nulls(tmp_path, input_path):
    gen = journal(tmp_path, "gen", [result(2), result(0), result(3)])  # row 1: no output
    # the final step is len(chunks) - 1: row 0 step 1, row 1 step 0; row 2 has no chunks, row 3 stopped at step 1 of 2
    chain = journal(tmp_path, "chain", [result(0, 0), result(0, 1), result(1, 0), result(3, 0), result(3, 1)])
    tech = journal(tmp_path, "tech", [result(1, 0, "tech answer")])
    general = journal(tmp_path, "general", [result(0, 0, "general answer"), result(1, 0, "general too")])
    spec = OutputSpec("results", "questions", {
        "question": ColumnRef(None, "question"),
        "chunks": ColumnRef(None, "chunks"),
        "answer": ColumnRef("gen", "text"),
        "answer_tokens": ColumnRef("gen", "num_prompt_tokens"),
        "summary": ColumnRef("chain", "text"),
        "summary_reason": ColumnRef("chain", "finish_reason"),
        "routed": ColumnRef("answer_merge", "text"),
    }, line=1)
    finals = {"gen": FinalSource(gen, None), "chain": FinalSource(chain, "chunks"),
              "tech": FinalSource(tech, None), "general": FinalSource(general, None)}
    path = tmp_path / "results.parquet"
    write_output_set(spec, InputFile(input_path, "id"), finals, {"answer_merge": ("tech", "general")}, path)
    table = pq.read_table(path)
    # the input's own types, every column nullable whatever the data holds
    assert table.schema == pa.schema([("row_id", pa.string()), ("question", pa.string()),
                                      ("chunks", pa.list_(pa.string())), ("answer", pa.string()),
                                      ("answer_tokens", pa.int64()), ("summary", pa.string()),
                                      ("summary_reason", pa.string()), ("routed", pa.string())])
    assert table.to_pydict() == {
        "row_id": ["70", "71", "72", "73"],
        "question": ["q0", "q1", "q2", "q3"],
        "chunks": [["a", "b"], ["c"], None, ["d", "e", "f"]],
        "answer": ["r0s0", None, "r2s0", "r3s0"],
        "answer_tokens": [100, None, 102, 103],
        "summary": ["r0s1", "r1s0", None, None],
        "summary_reason": ["stop", "stop", None, None],
        "routed": ["general answer", "tech answer", None, None],  # the first listed member that answered
    }


def test_output_set_without_id_column_numbers_the_rows(tmp_path, input_path):
    gen = journal(tmp_path, "gen", [result(1)])
    nothing = journal(tmp_path, "nothing", [])
    spec = OutputSpec("results", "questions", {"gen": ColumnRef("gen", "text"), "nothing": ColumnRef("nothing", "text")}, 1)
    path = tmp_path / "results.parquet"
    write_output_set(spec, InputFile(input_path, None), {"gen": FinalSource(gen, None), "nothing": FinalSource(nothing, None)},
                     {}, path)
    assert pq.read_table(path).to_pydict() == {"row_id": ["0", "1", "2", "3"], "gen": [None, "r1s0", None, None],
                                               "nothing": [None, None, None, None]}


def test_a_failed_write_keeps_the_previous_file(tmp_path, input_path):
    gen = journal(tmp_path, "gen", [result(0)])
    path = tmp_path / "results.parquet"
    good = OutputSpec("results", "questions", {"answer": ColumnRef("gen", "text")}, 1)
    write_output_set(good, InputFile(input_path, "id"), {"gen": FinalSource(gen, None)}, {}, path)
    before = path.read_bytes()
    with pytest.raises(duckdb.Error, match="len"):  # fails in DuckDB, after the temporary file was opened
        write_output_set(good, InputFile(input_path, "id"), {"gen": FinalSource(gen, "id")}, {}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet", "journal", "results.parquet"]
