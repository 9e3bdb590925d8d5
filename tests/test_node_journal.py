"""The node journal: appends, compaction into sorted segments, lookups, and exactly-once
recovery from a crash at every point of its protocol."""

from __future__ import annotations

import json

import numpy as np
import pytest

import batchllm.io.node_journal as node_journal
from batchllm.core.errors import UserError
from batchllm.io.journal_records import JournalStats, ResultRecord
from batchllm.io.node_journal import ResultJournal, read_records


def record(row: int, step: int = 0, text: str | None = None, reason: str = "stop") -> ResultRecord:
    return ResultRecord(row, step, (text or f"t{row}.{step}",), 10 + row, 2, reason)


def keys(journal: ResultJournal) -> list[tuple[int, int]]:
    rows, steps = journal.committed_keys()
    return sorted(zip(rows.tolist(), steps.tolist()))


def test_records_survive_reopening_and_compaction(tmp_path):
    journal = ResultJournal(tmp_path / "a", "fp", "a", segment_records=3)
    journal.append_many([record(5), record(1), record(3, 1)])  # the third record compacts the part
    journal.append_many([record(2)])
    journal.close()
    assert [p.name for p in sorted((tmp_path / "a").iterdir())] == ["header.json", "seg-000000.parquet", "tail-000001.jsonl"]
    reopened = ResultJournal(tmp_path / "a", "fp", "a", segment_records=3)
    assert keys(reopened) == [(1, 0), (2, 0), (3, 1), (5, 0)]
    assert reopened.texts(np.array([5, 2, 3, 3, 9]), np.array([0, 0, 1, 0, 0])) == ["t5.0", "t2.0", "t3.1", None, None]
    assert reopened.stats() == JournalStats(committed=4, failed=0, prompt_tokens=10 * 4 + 5 + 1 + 3 + 2, output_tokens=8)


@pytest.mark.parametrize("texts", [("plain",), ('quote " backslash \\ slash /',), ("new\nline\ttab\x00\x1f\u2028",),
                                   ("ünïcødé 日本 🙂", "second sample"), ("",)])
def test_a_tail_line_is_what_json_dumps_gives_and_reads_back(tmp_path, texts):
    item = ResultRecord(123456789, 7, texts, 40, 3, "error: it's \"odd\"")
    fields = {"row": 123456789, "step": 7, "texts": list(texts), "num_prompt_tokens": 40, "num_output_tokens": 3,
              "finish_reason": "error: it's \"odd\""}
    assert item.json_line() == json.dumps(fields, ensure_ascii=False)
    journal = ResultJournal(tmp_path / "a", "fp", "a", samples=len(texts))
    journal.append_many([item])
    journal.close()
    assert ResultJournal(tmp_path / "a", "fp", "a", samples=len(texts)).texts(np.array([123456789]), np.array([7])) == [texts[0]]


def test_texts_come_from_the_segments_whose_key_range_meets_them_before_and_after_reopening(tmp_path):
    journal = ResultJournal(tmp_path / "a", "fp", "a", segment_records=2)
    journal.append_many([record(8), record(1)])  # seg 0: rows 1..8
    journal.append_many([record(4, 2), record(20)])  # seg 1: rows 4..20, meets seg 0's range
    journal.append_many([record(30)])  # the tail
    rows, steps = np.array([20, 1, 4, 30, 8, 5, 4]), np.array([0, 0, 2, 0, 0, 0, 0])
    expected = ["t20.0", "t1.0", "t4.2", "t30.0", "t8.0", None, None]
    assert journal.texts(rows, steps) == expected
    journal.close()
    assert ResultJournal(tmp_path / "a", "fp", "a", segment_records=2).texts(rows, steps) == expected


def test_a_torn_last_line_is_cut_off(tmp_path):
    journal = ResultJournal(tmp_path / "a", "fp", "a")
    journal.append_many([record(0), record(1)])
    journal.close()
    tail = tmp_path / "a" / "tail-000000.jsonl"
    tail.write_bytes(tail.read_bytes() + b'{"row": 2, "step": 0, "te')
    reopened = ResultJournal(tmp_path / "a", "fp", "a")
    assert keys(reopened) == [(0, 0), (1, 0)]
    assert tail.read_bytes().endswith(b"}\n")


def test_appending_a_key_twice_is_an_error(tmp_path):
    journal = ResultJournal(tmp_path / "a", "fp", "a")
    journal.append_many([record(0)])
    with pytest.raises(RuntimeError, match="row 0 step 0 was already committed"):
        journal.append_many([record(0)])


def test_a_refused_batch_takes_none_of_its_records(tmp_path):
    journal = ResultJournal(tmp_path / "a", "fp", "a")
    journal.append_many([record(0)])
    with pytest.raises(RuntimeError, match="row 0 step 0 was already committed"):
        journal.append_many([record(1), record(0)])
    with pytest.raises(RuntimeError, match="row 2 step 0 was already committed"):
        journal.append_many([record(2), record(2)])
    assert keys(journal) == [(0, 0)]
    assert journal.texts(np.array([1, 2]), np.array([0, 0])) == [None, None]
    journal.append_many([record(1)])  # not taken before, so not a duplicate now
    journal.close()
    assert keys(ResultJournal(tmp_path / "a", "fp", "a")) == [(0, 0), (1, 0)]


def test_results_of_a_changed_node_are_refused(tmp_path):
    ResultJournal(tmp_path / "a", "fp", "a").close()
    with pytest.raises(UserError, match="different version of node 'a'"):
        ResultJournal(tmp_path / "a", "other", "a")


class Crash(BaseException):
    """Stands in for kill -9 between two steps of the compaction protocol."""


@pytest.mark.parametrize("step", ["write", "fsync-segment", "rename", "delete-tail", "open-next"])
def test_a_crash_at_any_step_of_compaction_leaves_every_record_exactly_once(tmp_path, monkeypatch, step):
    journal = ResultJournal(tmp_path / "a", "fp", "a", segment_records=4)
    journal.append_many([record(r) for r in range(3)])
    real = {"write": node_journal.pq.write_table, "fsync-segment": node_journal.os.fsync, "rename": node_journal.os.replace}
    calls = {"fsync": 0}

    def crash_on(name):
        def crashing(*args, **kwargs):
            raise Crash()
        return crashing

    if step == "write":
        monkeypatch.setattr(node_journal.pq, "write_table", crash_on(step))
    elif step == "fsync-segment":
        def fsync(fd):
            calls["fsync"] += 1
            if calls["fsync"] == 2:  # the first flushes the tail, the second the segment
                raise Crash()
            return real["fsync-segment"](fd)
        monkeypatch.setattr(node_journal.os, "fsync", fsync)
    elif step == "rename":
        monkeypatch.setattr(node_journal.os, "replace", crash_on(step))
    elif step == "delete-tail":
        monkeypatch.setattr(node_journal.Path, "unlink", crash_on(step))
    else:
        original = journal._tail_path

        def tail_path(part):
            if part == 1:  # opening the next part, after the old tail was deleted
                raise Crash()
            return original(part)
        monkeypatch.setattr(journal, "_tail_path", tail_path)
    with pytest.raises(Crash):
        journal.append_many([record(3)])
    monkeypatch.undo()
    reopened = ResultJournal(tmp_path / "a", "fp", "a", segment_records=4)
    assert keys(reopened) == [(r, 0) for r in range(4)]
    assert reopened.stats().committed == 4
    reopened.append_many([record(4)])  # and it goes on
    reopened.close()
    assert sorted(read_records(tmp_path / "a").column("row").to_pylist()) == [0, 1, 2, 3, 4]


def test_thirty_thousand_records_in_six_segments(tmp_path):
    # The same shape as a large run's journal (segments, a tail, shuffled rows, failures), at a tenth
    # of the scale: benchmarks/journal_scale.py shows the scale itself.
    journal = ResultJournal(tmp_path / "big", "fp", "big", segment_records=5_000)
    rows = np.random.default_rng(1).permutation(30_000)
    for start in range(0, len(rows), 100):
        journal.append_many([record(int(r), reason="error: x" if r % 1000 == 0 else "stop") for r in rows[start:start + 100]])
    journal.close()
    reopened = ResultJournal(tmp_path / "big", "fp", "big", segment_records=5_000)
    assert len(reopened.segment_paths()) == 6
    found_rows, _ = reopened.committed_keys()
    assert np.array_equal(np.sort(found_rows), np.arange(30_000))
    window = np.arange(12_000, 12_010)
    assert reopened.texts(window, np.zeros(10, np.int64)) == [f"t{r}.0" for r in window]
    assert reopened.stats().failed == 30


def test_committed_keys_come_a_segment_at_a_time_then_the_tail(tmp_path):
    journal = ResultJournal(tmp_path / "a", "fp", "a", segment_records=2)
    journal.append_many([record(4), record(0)])
    journal.append_many([record(3, 1), record(1)])
    journal.append_many([record(2)])
    batches = list(journal.committed_key_batches())
    assert [len(rows) for rows, _ in batches] == [2, 2, 1]
    assert sorted((r, s) for rows, steps in batches for r, s in zip(rows.tolist(), steps.tolist())) == keys(journal)


def test_a_damaged_line_in_the_middle_of_a_tail_is_set_aside_and_the_rest_stays_committed(tmp_path):
    journal = ResultJournal(tmp_path / "a", "fp", "a")
    journal.append_many([record(1), record(2), record(3), record(4)])
    journal.close()
    tail = tmp_path / "a" / "tail-000000.jsonl"
    lines = tail.read_bytes().split(b"\n")
    lines[1] = b'{"row": 2, "step": 0, "te\x00\xff garbage'  # a disk error inside line 2
    lines.insert(3, lines[2])  # and a copied line: a second result for row 3
    tail.write_bytes(b"\n".join(lines))
    reopened = ResultJournal(tmp_path / "a", "fp", "a")
    assert keys(reopened) == [(1, 0), (3, 0), (4, 0)]
    assert len(reopened.damage) == 1
    assert reopened.damage[0].startswith(f"{tail}: 2 damaged line(s) set aside in tail-000000.jsonl.damaged: line 2 (")
    assert "4 (a second result for row 3 step 0)" in reopened.damage[0]
    assert (tmp_path / "a" / "tail-000000.jsonl.damaged").read_bytes().count(b"\n") == 2
    reopened.append_many([record(2)])  # its unit computed again: committed once
    reopened.close()
    again = ResultJournal(tmp_path / "a", "fp", "a")
    assert keys(again) == [(1, 0), (2, 0), (3, 0), (4, 0)] and again.damage == []


def test_a_segment_that_does_not_read_is_set_aside(tmp_path):
    journal = ResultJournal(tmp_path / "a", "fp", "a", segment_records=2)
    journal.append_many([record(1), record(2)])  # compacted: seg-000000
    journal.append_many([record(3), record(4)])  # seg-000001
    journal.append_many([record(5)])
    journal.close()
    segment = tmp_path / "a" / "seg-000000.parquet"
    segment.write_bytes(segment.read_bytes()[:100])  # cut short: its footer is gone
    reopened = ResultJournal(tmp_path / "a", "fp", "a", segment_records=2)
    assert keys(reopened) == [(3, 0), (4, 0), (5, 0)]
    assert reopened.stats().committed == 3
    assert reopened.damage == [f"{segment} does not read (Parquet magic bytes not found in footer. Either the file is corrupted "
                               "or this is not a parquet file.): set aside as seg-000000.parquet.damaged; its units run again"]
