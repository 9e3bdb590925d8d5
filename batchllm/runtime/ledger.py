"""The request ledger: where every (node, row, step) of a run is.

A unit of work is (row, step) of a node: the row's position in its input, and the step
(0 for plain nodes; the list element for iterating nodes). Each node keeps one status per
unit and one admission state per row in numpy arrays (two bytes a row: 10 million rows
of a node in 20 MB), and the engine slot of each of its RUNNING units in a dict (`slot_of`:
its size bounded by what the engines run at once, whatever the data set's size); the run's
`Ledger` counts the units on each slot.

Invariant: a unit's status here is the only record of where it is. The feed renders READY
units and marks them QUEUED (their payload then waits in the node's backlog), the
executor marks them RUNNING on an engine slot when it submits them and COMMITTED when
their result is in the journal, and an engine's loss turns its RUNNING units back to
READY. Nothing else records which engine holds a unit or whether it is done; the
per-slot and per-status counts are kept in step with the arrays by the same calls.

Transitions:  WAITING -> READY -> QUEUED -> RUNNING -> COMMITTED
              READY <- RUNNING (engine lost);  WAITING/READY -> SKIPPED (the row is out)
              READY/QUEUED -> COMMITTED (its result taken from the result store: see runtime/reuse.py)

A unit's id is its index in its node's arrays (`unit_of`, `row_step_of` convert from and
to (row, step)); a request carries `request_id(node_index, unit)`, one integer, and its
result is traced back with `node_units` (the journal keys results by (row, step)).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from enum import IntEnum
from typing import NamedTuple

import numpy as np

UNIT_BITS = 40  # a node has fewer than 2**40 units; the node's index sits above them in a request id
UNIT_MASK = (1 << UNIT_BITS) - 1


def request_id(node_index: int, unit: int) -> int:
    """The id a unit's request carries: its node's index (topological order) and the unit."""
    return node_index << UNIT_BITS | unit


def node_units(request_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(node indices, units) of request ids."""
    request_ids = np.asarray(request_ids, np.int64)
    return request_ids >> UNIT_BITS, request_ids & UNIT_MASK


class UnitCounts(NamedTuple):
    """A node's units as its ledger counts them now: what the progress, the status file and the
    run summary show (they read these, and keep no count of their own)."""

    total: int  # taking part, or that may still (skipped rows' units excluded)
    committed: int
    expected: int  # `total` less the share of undecided rows' units that will likely be skipped


class UnitStatus(IntEnum):
    WAITING = 0  # its inputs are not all committed: an upstream output, or its previous step
    READY = 1  # its inputs are committed; not yet rendered
    QUEUED = 2  # rendered, waiting in the driver for an engine
    RUNNING = 3  # in an engine (see `slot`)
    COMMITTED = 4  # its result is in the journal
    SKIPPED = 5  # its row does not take part (`where:` is false, or an upstream has no output for it)


class RowState(IntEnum):
    PENDING = 0  # not decided yet: upstream outputs missing
    ADMITTED = 1
    SKIPPED = 2


class FinalState(IntEnum):
    """A row's final output of a node, as its consumers see it."""

    PENDING = 0
    COMMITTED = 1
    NONE = 2  # the node will never have an output for this row


class NodeLedger:
    def __init__(self, name: str, rows: int, steps: np.ndarray | None = None):
        """`steps`: per row, how many steps it has (iterating nodes); None: one each."""
        self.name, self.rows = name, rows
        if steps is None:
            self.offsets = None
            units = rows
        else:
            steps = np.asarray(steps, np.int64)
            if steps.shape != (rows,):
                raise ValueError(f"node {name!r}: {steps.shape[0]} step counts for {rows} rows")
            self.offsets = np.concatenate([[0], np.cumsum(steps)])
            units = int(self.offsets[-1])
        self.status = np.zeros(units, np.int8)
        self.row_state = np.zeros(rows, np.int8)
        self.counts = np.zeros(len(UnitStatus), np.int64)
        self.counts[UnitStatus.WAITING] = units
        self.row_counts = np.zeros(len(RowState), np.int64)  # rows per RowState, kept in step with row_state
        self.row_counts[RowState.PENDING] = rows
        self.slot_of: dict[int, int] = {}  # RUNNING unit -> its engine slot (kept by `Ledger`)

    # -- addressing ------------------------------------------------------------------
    @property
    def units(self) -> int:
        return int(self.status.size)

    def steps_of(self, rows: np.ndarray) -> np.ndarray:
        if self.offsets is None:
            return np.ones(len(rows), np.int64)
        return self.offsets[rows + 1] - self.offsets[rows]

    def unit_of(self, rows: np.ndarray, steps: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        return rows.copy() if self.offsets is None else self.offsets[rows] + np.asarray(steps, np.int64)

    def row_step_of(self, units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        units = np.asarray(units, np.int64)
        if self.offsets is None:
            return units, np.zeros(len(units), np.int64)
        rows = np.searchsorted(self.offsets, units, side="right") - 1
        return rows, units - self.offsets[rows]

    def unit_range(self, start_row: int, stop_row: int) -> tuple[int, int]:
        if self.offsets is None:
            return start_row, stop_row
        return int(self.offsets[start_row]), int(self.offsets[stop_row])

    # -- counts ----------------------------------------------------------------------
    @property
    def total_units(self) -> int:
        """Units that take part or may still take part (skipped rows' units excluded)."""
        return self.units - int(self.counts[UnitStatus.SKIPPED])

    @property
    def committed_units(self) -> int:
        return int(self.counts[UnitStatus.COMMITTED])

    @property
    def expected_units(self) -> int:
        """`total_units` less the share of the undecided rows' units that the decided rows
        suggest will be skipped (a `where:` branch, or a consumer of one): an estimate, for
        the time left, of what `total_units` will be once every row is decided."""
        pending, admitted, skipped = (int(self.row_counts[s]) for s in (RowState.PENDING, RowState.ADMITTED, RowState.SKIPPED))
        if not pending or not skipped:
            return self.total_units
        pending_units = pending * self.units / max(self.rows, 1)  # mean steps a row, for iterating nodes
        return self.total_units - round(pending_units * skipped / (admitted + skipped))

    def unit_counts(self) -> UnitCounts:
        return UnitCounts(self.total_units, self.committed_units, self.expected_units)

    def is_settled(self) -> bool:
        """Every unit committed or skipped."""
        return self.counts[UnitStatus.COMMITTED] + self.counts[UnitStatus.SKIPPED] == self.units

    def _move(self, units: np.ndarray, to: UnitStatus) -> None:
        if len(units):
            self.counts -= np.bincount(self.status[units], minlength=len(UnitStatus))
            self.status[units] = to
            self.counts[to] += len(units)

    # -- rows --------------------------------------------------------------------------
    def admit(self, rows: np.ndarray) -> None:
        """The rows take part: their first steps are READY."""
        rows = np.asarray(rows, np.int64)
        self._set_rows(rows, RowState.ADMITTED)
        if self.offsets is not None:
            rows = rows[self.steps_of(rows) > 0]
        first = self.unit_of(rows, np.zeros(len(rows), np.int64))
        self._move(first[self.status[first] == UnitStatus.WAITING], UnitStatus.READY)

    def skip(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows, np.int64)
        self._set_rows(rows, RowState.SKIPPED)
        self._move(self._units_of_rows(rows), UnitStatus.SKIPPED)

    def _set_rows(self, rows: np.ndarray, to: RowState) -> None:
        """`rows` distinct."""
        if len(rows):
            self.row_counts -= np.bincount(self.row_state[rows], minlength=len(RowState))
            self.row_state[rows] = to
            self.row_counts[to] += len(rows)

    def _units_of_rows(self, rows: np.ndarray) -> np.ndarray:
        if self.offsets is None:
            return rows
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        return np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)]) if len(rows) else rows

    def final_state(self, start_row: int, stop_row: int) -> np.ndarray:
        """Per row of [start, stop): PENDING, COMMITTED or NONE (see FinalState)."""
        return self.final_state_of(np.arange(start_row, stop_row))

    def final_state_of(self, rows: np.ndarray) -> np.ndarray:
        """final_state for scattered rows (sorted or not)."""
        rows = np.asarray(rows, np.int64)
        state = np.full(len(rows), FinalState.PENDING, np.int8)
        steps = self.steps_of(rows)
        has_steps = steps > 0
        last = self.unit_of(rows[has_steps], steps[has_steps] - 1)
        state[np.flatnonzero(has_steps)[self.status[last] == UnitStatus.COMMITTED]] = FinalState.COMMITTED
        state[(self.row_state[rows] == RowState.SKIPPED) | ~has_steps] = FinalState.NONE
        return state

    def final_steps(self, rows: np.ndarray) -> np.ndarray:
        return self.steps_of(np.asarray(rows, np.int64)) - 1

    # -- units -------------------------------------------------------------------------
    def queue(self, units: np.ndarray) -> None:
        units = np.asarray(units, np.int64)
        bad = units[self.status[units] != UnitStatus.READY]
        if len(bad):
            raise ValueError(f"node {self.name!r}: unit {int(bad[0])} is {UnitStatus(self.status[bad[0]]).name}, not READY")
        self._move(units, UnitStatus.QUEUED)

    def run(self, units: np.ndarray) -> None:
        """QUEUED units went to an engine (`Ledger.send` records which)."""
        self._move(units, UnitStatus.RUNNING)

    def commit(self, units: np.ndarray) -> np.ndarray:
        """Results are in the journal. Returns the units that became READY (next steps)."""
        units = np.asarray(units, np.int64)
        self._move(units, UnitStatus.COMMITTED)
        if self.offsets is None:
            return units[:0]
        following = units + 1
        rows, _ = self.row_step_of(units)
        following = following[following < self.offsets[rows + 1]]
        following = following[self.status[following] == UnitStatus.WAITING]
        self._move(following, UnitStatus.READY)
        return following

    def reuse(self, units: np.ndarray) -> np.ndarray:
        """READY or QUEUED units whose results were taken from the result store into the journal
        (they never reach an engine). Returns the units that became READY (next steps)."""
        units = np.asarray(units, np.int64)
        bad = units[(self.status[units] != UnitStatus.READY) & (self.status[units] != UnitStatus.QUEUED)]
        if len(bad):
            raise ValueError(f"node {self.name!r}: a stored result for unit {int(bad[0])}, which is "
                             f"{UnitStatus(self.status[bad[0]]).name}, not READY or QUEUED")
        return self.commit(units)

    def make_ready(self, units: np.ndarray) -> None:
        """RUNNING units whose engine was stopped or lost are READY again."""
        self._move(units, UnitStatus.READY)

    def restore_committed(self, rows: np.ndarray, steps: np.ndarray) -> None:
        """At resume: what the journal holds. Rows with a committed unit were admitted;
        for iterating nodes the step after a row's last committed one is READY."""
        rows = np.asarray(rows, np.int64)
        units = self.unit_of(rows, steps)
        self._set_rows(np.unique(rows) if self.offsets is not None else rows, RowState.ADMITTED)  # a row per step
        self._move(units, UnitStatus.COMMITTED)
        if self.offsets is not None:
            following = units + 1
            following = following[following < self.offsets[rows + 1]]
            self._move(following[self.status[following] == UnitStatus.WAITING], UnitStatus.READY)


class Ledger:
    """Every node's ledger, and the units on each engine slot.

    Invariant: a unit has a slot (in its node's `NodeLedger.slot_of`) exactly while its status is
    RUNNING, and `running_on[slot]` counts the units on that slot; both change only in `send`,
    `commit` and `release`, together with the unit's status."""

    def __init__(self, nodes: Iterable[NodeLedger]):
        self.nodes = list(nodes)  # in the run's order
        self.running_on: Counter[int] = Counter()

    def __getitem__(self, node: str) -> NodeLedger:
        return next(ledger for ledger in self.nodes if ledger.name == node)

    def send(self, node: str, units: np.ndarray, slot: int) -> None:
        units = np.asarray(units, np.int64)
        ledger = self[node]
        ledger.run(units)
        ledger.slot_of.update(dict.fromkeys(units.tolist(), slot))
        self.running_on[slot] += len(units)

    def slots_of(self, node: str, units: np.ndarray) -> np.ndarray:
        """The engine slot of each of these RUNNING units of `node`."""
        slot_of = self[node].slot_of
        return np.fromiter((slot_of[u] for u in np.asarray(units, np.int64).tolist()), np.int64, len(units))

    def commit(self, node: str, units: np.ndarray) -> np.ndarray:
        """Results of RUNNING units are in the journal. Returns the units that became READY."""
        ledger = self[node]
        units = np.asarray(units, np.int64)
        not_running = units[ledger.status[units] != UnitStatus.RUNNING]
        if len(not_running):
            raise ValueError(f"node {node!r}: a result for unit {int(not_running[0])}, which is "
                             f"{UnitStatus(ledger.status[not_running[0]]).name}, not RUNNING")
        for slot, count in zip(*np.unique(self.slots_of(node, units), return_counts=True)):
            self.running_on[int(slot)] -= int(count)
        for unit in units.tolist():
            del ledger.slot_of[unit]
        return ledger.commit(units)

    def release(self, slot: int) -> dict[str, np.ndarray]:
        """The slot's engine is gone: per node, its units that are READY again."""
        self.running_on.pop(slot, None)
        released = {}
        for ledger in self.nodes:
            units = np.array(sorted(u for u, s in ledger.slot_of.items() if s == slot), np.int64)
            if len(units):
                for unit in units.tolist():
                    del ledger.slot_of[unit]
                ledger.make_ready(units)
                released[ledger.name] = units
        return released
