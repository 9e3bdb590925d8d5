"""The result store (`io/result_store.py`): records come back whole and bit for bit, misses are
misses, the least recently used go first, a damaged entry is never returned, a bad file or a
full disk is a UserError naming the store, and two processes write one store at once."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from batchllm.core.errors import UserError
from batchllm.core.requests import TokenLogprob
from batchllm.io.journal_records import ResultRecord
from batchllm.io.result_store import ResultStore, checksum_of, payload_of

RUN = "runs/demo 2026-12-07T18:55:01"
T0 = 1_796_670_000.0  # 2026-12-07 19:00 UTC


def key(name: object) -> bytes:
    return hashlib.blake2b(str(name).encode(), digest_size=32).digest()


SCOPE = key("scope: smollm2-135m, temperature 0")


def text_record(text: str, row: int = 7, step: int = 3) -> ResultRecord:
    return ResultRecord(row, step, (text,), 10, 5, "stop")


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def path(tmp_path):
    return tmp_path / "store" / "results.sqlite"


def test_generation_records_come_back_whole_with_row_and_step_zero(path):
    texts = ResultRecord(4, 1, ("héllo\nwörld 🎉", "a second\r\nsample\u2028with a line separator"), 12, 9, "length",
                         (TokenLogprob("hé", -0.125, (("hé", -0.125), ("ha", -2.5))), TokenLogprob("\n", -1e-9, ())))
    with ResultStore(path) as store:
        store.put_many([(key("a"), SCOPE, texts), (key("b"), SCOPE, text_record("error: boom"))], RUN)
        found = store.get_many([key("a"), key("b"), key("missing")])
    assert found[key("a")].record == texts._replace(row=0, step=0)
    assert found[key("b")].record == text_record("error: boom", 0, 0)
    assert key("missing") not in found and len(found) == 2


def test_an_embed_vector_comes_back_bit_for_bit_and_a_score_exactly(path):
    vector = np.array([1 / 3, -0.0, 1e-38, np.float32(np.inf), 3.4e38, np.nextafter(np.float32(1), np.float32(2))], np.float32)
    with ResultStore(path) as store:
        store.put_many([(key("v"), SCOPE, ResultRecord(0, 0, ("",), 4, 0, "stop", vector=vector)),
                        (key("s"), SCOPE, ResultRecord(0, 0, ("",), 4, 0, "stop", score=0.1 + 0.2))], RUN)
    with ResultStore(path) as store:  # read back by another connection
        found = store.get_many([key("v"), key("s")])
    assert found[key("v")].record.vector.tobytes() == vector.tobytes()
    assert found[key("s")].record.score == 0.1 + 0.2


def test_provenance_is_kept_and_the_first_answer_stays(path):
    clock = Clock()
    with ResultStore(path, clock=clock) as store:
        store.put_many([(key("a"), SCOPE, text_record("first"))], RUN)
        clock.now += 60
        store.put_many([(key("a"), SCOPE, text_record("second"))], "runs/other")
        hit = store.get_many([key("a")])[key("a")]
        assert (hit.record.text, hit.run, hit.stored_at_s) == ("first", RUN, T0)
        assert store.usage().entries == 1


def test_has_scope(path):
    with ResultStore(path) as store:
        assert not store.has_scope(SCOPE)
        store.put_many([(key("a"), SCOPE, text_record("x"))], RUN)
        assert store.has_scope(SCOPE) and not store.has_scope(key("another scope"))


def test_many_keys_in_batches_hits_and_misses(path):
    with ResultStore(path) as store:
        store.put_many([(key(k), SCOPE, text_record(f"answer {k}")) for k in range(0, 3000, 2)], RUN)
        found = store.get_many([key(k) for k in range(3000)])
        assert {hit.record.text for hit in found.values()} == {f"answer {k}" for k in range(0, 3000, 2)}
        assert all(found[key(k)].record.text == f"answer {k}" for k in range(0, 3000, 2))
        assert store.usage().entries == 1500


def test_a_put_past_the_cap_evicts_the_least_recently_used(path):
    clock = Clock()
    size = len(payload_of(text_record("a")))
    with ResultStore(path, cap_bytes=3 * size, clock=clock) as store:
        for name in "abc":
            store.put_many([(key(name), SCOPE, text_record(name))], RUN)
            clock.now += 1
        clock.now += 7200  # older than an hour: a read marks it used again
        assert key("a") in store.get_many([key("a")])
        store.put_many([(key("d"), SCOPE, text_record("d"))], RUN)
        assert sorted(hit.record.text for hit in store.get_many([key(n) for n in "abcd"]).values()) == ["a", "c", "d"]
        usage = store.usage()
        assert (usage.entries, usage.payload_bytes, usage.cap_bytes) == (3, 3 * size, 3 * size)


def test_prune_by_age_then_by_size(path):
    clock = Clock()
    size = len(payload_of(text_record("a")))
    with ResultStore(path, clock=clock) as store:
        for day, name in enumerate("abcd"):
            clock.now = T0 + day * 86_400
            store.put_many([(key(name), SCOPE, text_record(name))], RUN)
        clock.now = T0 + 4 * 86_400
        assert store.prune(older_than_s=2.5 * 86_400) == 2  # a and b
        assert store.prune(max_bytes=size) == 1  # c
        usage = store.usage()
        assert (usage.entries, usage.payload_bytes, usage.oldest_use_s, usage.newest_use_s) == (1, size, T0 + 3 * 86_400,
                                                                                                   T0 + 3 * 86_400)
        assert [hit.record.text for hit in store.get_many([key(n) for n in "abcd"]).values()] == ["d"]
        assert store.usage().newest_use_s == T0 + 4 * 86_400  # read a day after its last use: used now


@pytest.mark.parametrize("damage", ["a flipped byte", "a payload that is not a record"])
def test_a_damaged_entry_is_set_aside_and_computed_again(path, damage):
    with ResultStore(path) as store:
        store.put_many([(key("a"), SCOPE, text_record("fine")), (key("b"), SCOPE, text_record("to damage"))], RUN)
        with sqlite3.connect(path) as raw:
            if damage == "a flipped byte":
                payload = raw.execute("SELECT payload FROM results WHERE key = ?", (key("b"),)).fetchone()[0]
                payload = payload.replace(b"to damage", b"to damagd")  # e -> d: one bit, still a record
                raw.execute("UPDATE results SET payload = ? WHERE key = ?", (payload, key("b")))
            else:  # whole as far as its checksum says, but not a record
                payload = b'{"row": 0, "texts": []}'
                raw.execute("UPDATE results SET payload = ?, checksum = ? WHERE key = ?", (payload, checksum_of(key("b"), payload), key("b")))
        assert list(store.get_many([key("a"), key("b")])) == [key("a")]
        usage = store.usage()
        assert (usage.entries, usage.damaged, usage.payload_bytes) == (1, 1, len(payload_of(text_record("fine"))))
        store.put_many([(key("b"), SCOPE, text_record("computed again"))], RUN)
        assert store.get_many([key("b")])[key("b")].record.text == "computed again"
        assert store.usage().damaged == 1


def test_a_file_that_is_not_a_database_is_a_user_error_naming_it(path):
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a database at all\n" * 200)
    with pytest.raises(UserError) as raised:
        ResultStore(path)
    assert raised.value.where == str(path) and "move it away" in raised.value.hint
    assert path.read_bytes() == b"not a database at all\n" * 200  # left as it was


def test_a_folder_in_the_way_another_database_and_a_newer_store_are_user_errors(path):
    path.mkdir(parents=True)
    with pytest.raises(UserError, match="a folder is in the way"):
        ResultStore(path)
    other = path.parent / "other.sqlite"
    with sqlite3.connect(other) as raw:
        raw.execute("CREATE TABLE users (name TEXT)")
    with pytest.raises(UserError, match="not a result store .it holds users"):
        ResultStore(other)
    newer = path.parent / "newer.sqlite"
    ResultStore(newer).close()
    with sqlite3.connect(newer) as raw:
        raw.execute("PRAGMA user_version = 99")
    with pytest.raises(UserError, match="newer batchllm"):
        ResultStore(newer)


def test_a_full_disk_is_a_user_error_naming_the_store_and_keeps_what_was_stored(path):
    with ResultStore(path, max_pages=40) as store:  # 160 KiB of 4 KiB pages
        store.put_many([(key(k), SCOPE, text_record(f"early {k}")) for k in range(10)], RUN)
        with pytest.raises(UserError) as raised:
            store.put_many([(key(f"big {k}"), SCOPE, text_record("x" * 1000)) for k in range(500)], RUN)
        assert raised.value.where == str(path)
        assert "is full (10 entries" in raised.value.message and "batchllm store prune" in raised.value.hint
        assert len(store.get_many([key(k) for k in range(10)])) == 10
        assert not store.get_many([key("big 0")]) and store.usage().entries == 10
        store.put_many([(key("small"), SCOPE, text_record("still fits"))], RUN)
        assert store.get_many([key("small")])[key("small")].record.text == "still fits"


WRITER = textwrap.dedent("""
    import hashlib, sys
    from pathlib import Path
    from batchllm.io.journal_records import ResultRecord
    from batchllm.io.result_store import ResultStore
    path, first, name = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    key = lambda k: hashlib.blake2b(str(k).encode(), digest_size=32).digest()
    with ResultStore(path) as store:
        for start in range(first, first + 2000, 50):
            store.put_many([(key(k), b"scope", ResultRecord(0, 0, (f"{k} by {name}",), 1, 1, "stop"))
                            for k in range(start, start + 50)], name)
""")


def test_two_processes_write_overlapping_keys_at_once(path):
    ResultStore(path).close()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(first), name])
               for first, name in ((0, "one"), (1000, "two"))]
    assert [writer.wait(timeout=120) for writer in writers] == [0, 0]
    with ResultStore(path) as store:
        found = store.get_many([key(k) for k in range(3000)])
        assert len(found) == 3000 and store.usage().entries == 3000
        assert all(found[key(k)].record.text == f"{k} by {found[key(k)].run}" for k in range(3000))
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone() == ("ok",)
