"""The request ledger: unit addressing, transitions, counts, what consumers see as final."""

from __future__ import annotations

import numpy as np
import pytest

from batchllm.runtime.ledger import FinalState, Ledger, NodeLedger, RowState, UnitStatus

S = UnitStatus


def statuses(ledger: NodeLedger) -> list[str]:
    return [S(s).name for s in ledger.status]


def test_plain_node_walks_every_status_and_keeps_counts():
    node = NodeLedger("a", rows=4)
    ledger = Ledger([node])
    node.admit(np.array([0, 1, 2]))
    node.skip(np.array([3]))
    assert statuses(node) == ["READY", "READY", "READY", "SKIPPED"]
    node.queue(np.array([0, 1]))
    ledger.send("a", np.array([0, 1]), slot=7)
    assert ledger.running_on[7] == 2 and list(ledger.slots_of("a", np.array([0, 1]))) == [7, 7]
    assert ledger.commit("a", np.array([1])).size == 0
    assert statuses(node) == ["RUNNING", "COMMITTED", "READY", "SKIPPED"]
    assert ledger.running_on[7] == 1
    assert (node.total_units, node.committed_units, node.is_settled()) == (3, 1, False)
    assert list(node.counts) == [0, 1, 0, 1, 1, 1]


def test_a_lost_engine_gives_its_running_units_back_as_ready():
    node = NodeLedger("a", rows=3)
    ledger = Ledger([node])
    node.admit(np.arange(3))
    node.queue(np.arange(3))
    ledger.send("a", np.array([0, 1]), slot=1)
    ledger.send("a", np.array([2]), slot=2)
    released = ledger.release(1)
    assert list(released["a"]) == [0, 1]
    assert statuses(node) == ["READY", "READY", "RUNNING"]
    assert 1 not in ledger.running_on and ledger.running_on[2] == 1


def test_a_result_for_a_unit_not_running_is_refused_with_its_status():
    node = NodeLedger("a", rows=2)
    ledger = Ledger([node])
    node.admit(np.arange(2))
    with pytest.raises(ValueError, match="unit 1, which is READY, not RUNNING"):
        ledger.commit("a", np.array([1]))
    node.queue(np.array([0]))
    with pytest.raises(ValueError, match="unit 0 is QUEUED, not READY"):
        node.queue(np.array([0]))


def test_iterating_node_units_follow_their_rows_steps_one_at_a_time():
    node = NodeLedger("chain", rows=3, steps=np.array([2, 0, 3]))
    ledger = Ledger([node])
    assert node.units == 5 and list(node.offsets) == [0, 2, 2, 5]
    rows, steps = node.row_step_of(np.array([0, 1, 2, 3, 4]))
    assert list(rows) == [0, 0, 2, 2, 2] and list(steps) == [0, 1, 0, 1, 2]
    node.admit(np.array([0, 1, 2]))
    assert statuses(node) == ["READY", "WAITING", "READY", "WAITING", "WAITING"]
    node.queue(np.array([0, 2]))
    ledger.send("chain", np.array([0, 2]), slot=0)
    assert list(ledger.commit("chain", np.array([2]))) == [3]  # row 2's step 1 is ready
    assert statuses(node) == ["RUNNING", "WAITING", "COMMITTED", "READY", "WAITING"]
    assert list(node.final_state(0, 3)) == [FinalState.PENDING, FinalState.NONE, FinalState.PENDING]


def test_final_state_tells_consumers_committed_pending_and_never():
    node = NodeLedger("p", rows=4)
    ledger = Ledger([node])
    node.admit(np.array([0, 1, 2]))
    node.skip(np.array([3]))
    node.queue(np.array([0, 1]))
    ledger.send("p", np.array([0, 1]), slot=0)
    ledger.commit("p", np.array([1]))
    assert list(node.final_state(0, 4)) == [FinalState.PENDING, FinalState.COMMITTED, FinalState.PENDING, FinalState.NONE]
    assert list(node.final_state(1, 3)) == [FinalState.COMMITTED, FinalState.PENDING]


def test_restore_from_the_journal_commits_and_readies_the_next_steps():
    node = NodeLedger("chain", rows=3, steps=np.array([2, 1, 3]))
    node.restore_committed(np.array([0, 2]), np.array([0, 0]))
    assert statuses(node) == ["COMMITTED", "READY", "WAITING", "COMMITTED", "READY", "WAITING"]
    assert list(node.row_state) == [RowState.ADMITTED, RowState.PENDING, RowState.ADMITTED]
    assert node.committed_units == 2


def test_a_step_count_per_row_must_match_the_rows():
    with pytest.raises(ValueError, match="2 step counts for 3 rows"):
        NodeLedger("x", rows=3, steps=np.array([1, 1]))


def test_ten_million_units_cost_two_bytes_each():
    node = NodeLedger("big", rows=10_000_000)
    assert node.status.nbytes + node.row_state.nbytes == 20_000_000


def test_restoring_in_batches_in_any_order_equals_restoring_at_once():
    rows, steps = np.array([0, 0, 2, 2]), np.array([0, 1, 1, 0])
    whole = NodeLedger("chain", rows=3, steps=np.array([3, 1, 3]))
    whole.restore_committed(rows, steps)
    batched = NodeLedger("chain", rows=3, steps=np.array([3, 1, 3]))
    for part in (slice(2, 4), slice(0, 2)):
        batched.restore_committed(rows[part], steps[part])
    assert statuses(batched) == statuses(whole) == ["COMMITTED", "COMMITTED", "READY", "WAITING", "COMMITTED", "COMMITTED", "READY"]
    assert list(batched.counts) == list(whole.counts) and list(batched.row_state) == list(whole.row_state)


def test_expected_units_take_the_decided_rows_skip_share_to_the_undecided_ones():
    ledger = NodeLedger("tech", 1_000)
    assert ledger.expected_units == 1_000  # nothing decided: every row may take part
    ledger.admit(np.arange(0, 40))
    assert ledger.expected_units == 1_000  # nothing skipped yet
    ledger.skip(np.arange(40, 100))  # 40 of 100 decided rows kept
    assert (ledger.total_units, ledger.expected_units) == (940, 40 + round(900 * 0.4))
    ledger.admit(np.arange(100, 1_000))  # all decided: the estimate is the total
    assert (ledger.total_units, ledger.expected_units) == (940, 940)
    assert list(ledger.row_counts) == [0, 940, 60]


def test_expected_units_of_an_iterating_node_count_its_mean_steps_and_restores_count_rows_once():
    ledger = NodeLedger("chain", 4, steps=np.array([2, 2, 4, 0]))  # 8 units, 2 a row on average
    ledger.restore_committed(np.array([0, 0]), np.array([0, 1]))  # both steps of row 0: one row admitted
    ledger.skip(np.array([1]))
    assert list(ledger.row_counts) == [2, 1, 1]
    assert ledger.expected_units == (8 - 2) - round(2 * 2 * 0.5)
