from __future__ import annotations

import pytest

from batchllm.errors import UserError
from batchllm.io.journal import ResultJournal, ResultRecord


def record(row: str, step: int = 0, text: str = "t") -> ResultRecord:
    return ResultRecord(row, step, (text,), 3, 1, "stop")


def test_records_survive_reopening(tmp_path):
    path = tmp_path / "j" / "node.jsonl"
    journal = ResultJournal(path, "fp1", "node")
    journal.append(record("r1", text="héllo\nworld"))
    journal.append(record("r1", 1))
    journal.close()
    reopened = ResultJournal(path, "fp1", "node")
    assert reopened.records == {("r1", 0): record("r1", text="héllo\nworld"), ("r1", 1): record("r1", 1)}


def test_a_torn_last_line_is_dropped_and_cut_off(tmp_path):
    path = tmp_path / "node.jsonl"
    journal = ResultJournal(path, "fp1", "node")
    journal.append(record("r1"))
    journal.close()
    committed = path.read_bytes()
    with open(path, "ab") as handle:
        handle.write(b'{"row_id": "r2", "step": 0, "te')  # a crash in the middle of a write
    reopened = ResultJournal(path, "fp1", "node")
    assert set(reopened.records) == {("r1", 0)}
    assert path.read_bytes() == committed
    reopened.append(record("r2"))
    reopened.close()
    assert set(ResultJournal(path, "fp1", "node").records) == {("r1", 0), ("r2", 0)}


def test_appending_a_key_twice_is_an_error(tmp_path):
    journal = ResultJournal(tmp_path / "node.jsonl", "fp1", "node")
    journal.append(record("r1"))
    with pytest.raises(RuntimeError, match="already committed"):
        journal.append(record("r1"))


def test_results_of_a_changed_node_are_not_reused(tmp_path):
    path = tmp_path / "out" / ".batchllm" / "journal" / "node.jsonl"
    ResultJournal(path, "fp1", "node").close()
    with pytest.raises(UserError, match="different version of node 'node'") as error:
        ResultJournal(path, "fp2", "node")
    assert "--fresh" in error.value.paragraph()
