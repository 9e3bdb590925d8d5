"""A node's feed over the ledger: rows admitted as producers commit them, `where:` and merges
decided per window, units rendered from the input and the journals, requeued units found."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import batchllm.runtime.node_feed as node_feed
from batchllm.dag.model import InputSpec, NodeSpec, SamplingSpec
from batchllm.io.input_source import open_input
from batchllm.io.journal_records import ResultRecord
from batchllm.io.node_journal import ResultJournal
from batchllm.runtime.ledger import Ledger, NodeLedger, UnitStatus, request_id
from batchllm.runtime.node_feed import MergedUpstream, NodeFeed, Upstream


def node(name: str, prompt: str, upstream=(), where=None, merges_read=()) -> NodeSpec:
    return NodeSpec(name=name, model="m", input_name="q", prompt=prompt, system=None, chat=True, sampling=SamplingSpec(),
                    where=where, iterate=None, line=1, upstream=tuple(upstream), columns_used=("text",),
                    merges_read=tuple(merges_read))


class World:
    """Producers with ledgers and journals over a 6-row input, committed by hand."""

    def __init__(self, tmp_path, producers=("router",)):
        path = tmp_path / "rows.parquet"
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(6)], "text": [f"x{i}" for i in range(6)]}), path)
        self.source = open_input(InputSpec("q", path, "id", 1))
        self.ledgers = {p: NodeLedger(p, 6) for p in producers}
        self.ledger = Ledger(self.ledgers.values())
        self.journals = {p: ResultJournal(tmp_path / p, "fp", p) for p in producers}

    def commit(self, producer: str, rows: list[int], texts: list[str]) -> None:
        units = np.array(rows)
        ledger = self.ledgers[producer]
        ledger.admit(units)
        ledger.queue(units)
        self.ledger.send(producer, units, slot=0)
        self.journals[producer].append_many([ResultRecord(r, 0, (t,), 1, 1, "stop") for r, t in zip(rows, texts)])
        self.ledger.commit(producer, units)

    def feed(self, spec: NodeSpec, tmp_path, upstream) -> NodeFeed:
        ledger = NodeLedger(spec.name, 6)
        return NodeFeed(spec, 3, ledger, self.source, ResultJournal(tmp_path / spec.name, "fp", spec.name), upstream)


def test_a_consumer_takes_rows_as_its_producer_commits_them_and_routes_by_where(tmp_path):
    world = World(tmp_path)
    up = {"router": Upstream(world.ledgers["router"], world.journals["router"])}
    feed = world.feed(node("expert", "{{ text }} / {{ router }}", ["router"], where="router = 'yes'"), tmp_path, up)
    assert len(feed.take_ready(10)) == 0 and feed.cursor == 0  # nothing committed upstream yet
    world.commit("router", [0, 2, 3], ["yes", "no", "yes"])
    units = feed.take_ready(10)
    assert list(units) == [0, 3]
    assert [UnitStatus(s).name for s in feed.ledger.status] == ["QUEUED", "WAITING", "SKIPPED", "QUEUED", "WAITING", "WAITING"]
    requests = feed.render(units)
    assert [(r.request_id, r.prompt) for r in requests] == [(request_id(3, 0), "x0 / yes"), (request_id(3, 3), "x3 / yes")]
    world.ledgers["router"].skip(np.array([1, 4, 5]))  # the router has no output for these rows
    assert len(feed.take_ready(10)) == 0 and not feed.ledger.is_settled()  # rows 0 and 3 are queued
    assert feed.cursor == 6 and not feed.has_more()


def test_a_merge_reads_the_first_member_that_answered_once_all_are_decided(tmp_path):
    world = World(tmp_path, producers=("tech", "general"))
    members = [Upstream(world.ledgers[p], world.journals[p]) for p in ("tech", "general")]
    feed = world.feed(node("judge", "{{ answer }}", ["general", "tech"], merges_read=["answer"]), tmp_path,
                      {"answer": MergedUpstream(members)})
    world.commit("general", [0, 1], ["g0", "g1"])
    world.ledgers["tech"].skip(np.array([1]))
    assert list(feed.take_ready(10)) == [1]  # row 0 waits: tech may still answer it
    world.commit("tech", [0], ["t0"])
    world.ledgers["general"].skip(np.array([2]))
    world.ledgers["tech"].skip(np.array([2]))
    units = feed.take_ready(10)
    assert list(units) == [0] and feed.ledger.row_state[2] == 2  # row 2: nobody answered, skipped
    assert [r.prompt for r in feed.render(np.array([0, 1]))] == ["t0", "g1"]


def test_units_lost_with_an_engine_are_found_again_behind_the_cursor(tmp_path, monkeypatch):
    monkeypatch.setattr(node_feed, "ADMIT_WINDOW_ROWS", 2)
    world = World(tmp_path, producers=())
    feed = world.feed(node("gen", "{{ text }}"), tmp_path, {})
    ledger = Ledger([feed.ledger])
    units = feed.take_ready(6)
    assert list(units) == [0, 1, 2, 3, 4, 5] and feed.cursor == 6
    ledger.send("gen", units, slot=4)
    feed.requeue(ledger.release(4)["gen"])
    assert list(feed.take_ready(4)) == [0, 1, 2, 3] and list(feed.take_ready(4)) == [4, 5]
    assert len(feed.take_ready(4)) == 0


def test_a_pilots_units_stopped_with_its_engine_ahead_of_the_cursor_are_taken_once(tmp_path):
    world = World(tmp_path, producers=())
    feed = world.feed(node("gen", "{{ text }}", where="text != 'x2'"), tmp_path, {})
    ledger = Ledger([feed.ledger])
    pilot = feed.take_rows(np.array([1, 2, 4]))  # a pilot's sample: taken without moving the cursor
    assert list(pilot) == [1, 4] and feed.cursor == 0
    ledger.send("gen", pilot, slot=2)
    feed.requeue(ledger.release(2)["gen"])  # its engine stopped at a stage's end: READY again
    feed.requeue(np.array([4]))  # and found again another way before it was taken
    units = feed.take_ready(10)
    assert sorted(units.tolist()) == [0, 1, 3, 4, 5] and len(set(units.tolist())) == len(units)  # 2 skipped by where:
    assert list(units[:2]) == [1, 4]  # the retried first
    assert (feed.ledger.status[units] == UnitStatus.QUEUED).all() and len(feed.take_ready(10)) == 0


def test_while_its_pilot_runs_a_node_takes_back_only_the_pilots_units_its_engine_lost(tmp_path):
    world = World(tmp_path, producers=())
    feed = world.feed(node("gen", "{{ text }}"), tmp_path, {})
    ledger = Ledger([feed.ledger])
    pilot = feed.take_rows(np.array([1, 4]))
    ledger.send("gen", pilot, slot=2)
    feed.requeue(ledger.release(2)["gen"])
    assert list(feed.take_retried(10)) == [1, 4] and len(feed.take_retried(10)) == 0  # not the rows after the cursor
    assert list(feed.take_ready(10)) == [0, 2, 3, 5]


def test_one_call_passes_every_decided_window_and_decides_a_bounded_number(tmp_path, monkeypatch):
    monkeypatch.setattr(node_feed, "ADMIT_WINDOW_ROWS", 1)
    monkeypatch.setattr(node_feed, "DECIDING_WINDOWS", 1)
    world = World(tmp_path, producers=())
    feed = world.feed(node("gen", "{{ text }}"), tmp_path, {})
    feed.ledger.restore_committed(np.array([0, 1, 2, 3]), np.zeros(4, np.int64))  # a resume: 4 rows done
    assert list(feed.take_ready(10)) == [4] and feed.cursor == 5  # rows 0-3 passed, one row decided
    assert list(feed.take_ready(10)) == [5] and not feed.has_more()
