"""A node's feed: finds its units that are ready and renders them into requests, a window
of rows at a time, so memory stays bounded whatever the data set's size.

Admission: a row takes part once every upstream node it reads has its final output
committed (checked over the ledger, a window of rows at once) and its `where:` holds
(DuckDB over the window's columns and upstream texts); a row an upstream node has no
output for never takes part. Rendering reads only the rows it renders: input columns
from the input source, upstream texts and an iterating node's previous step from the
journals.

Invariant: every row before `cursor` is decided (admitted or skipped), and every READY
unit before it is in `retry` (requeued after an engine was lost, or the next step of an
iterating row); so a scan from `cursor` plus `retry` finds every READY unit.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np
import pyarrow as pa

from batchllm.core.requests import EngineRequest
from batchllm.dag.context import template_context
from batchllm.dag.model import NodeSpec
from batchllm.dag.node_prompt import NodePrompt
from batchllm.dag.sql_names import sql_identifiers
from batchllm.io.input_source import ROW_ID, InputSource
from batchllm.io.node_journal import ResultJournal
from batchllm.io.sql import WhereFilter
from batchllm.runtime.ledger import FinalState, NodeLedger, RowState, UnitStatus, request_id

ADMIT_WINDOW_ROWS = 16_384  # rows admitted per scan step
DECIDING_WINDOWS = 8  # windows with undecided rows one call looks at for ready units (a selective `where:`
# needs several to fill a window); windows whose rows are all decided cost microseconds and are passed
# without counting (a resume past millions of committed rows feeds the engines at once)
POSITION = "__batchllm_position"


class Upstream:
    """A producer as its consumers see it: its ledger (what is final) and its journal (the values:
    a generation node's texts, a score node's numbers)."""

    def __init__(self, ledger: NodeLedger, journal: ResultJournal):
        self.ledger, self.journal = ledger, journal

    def final_state(self, start_row: int, stop_row: int) -> np.ndarray:
        return self.ledger.final_state(start_row, stop_row)

    @property
    def arrow_type(self) -> pa.DataType:
        """Its values' type in `where:` (a score node's are float64)."""
        return pa.float64() if self.journal.scores_kept else pa.string()

    def values(self, rows: np.ndarray) -> list:
        if self.journal.scores_kept:
            return self.journal.scores(rows, self.ledger.final_steps(rows))
        return self.journal.texts(rows, self.ledger.final_steps(rows))

    def vectors(self, rows: np.ndarray) -> list[np.ndarray | None]:
        return self.journal.vectors(rows, self.ledger.final_steps(rows))


class Nearest(Protocol):
    """A nearest list as a node's feed sees it (`runtime.nearest_rows.NearestRows`)."""

    def final_state(self, start_row: int, stop_row: int) -> np.ndarray: ...

    def values(self, rows: np.ndarray) -> list[list[dict[str, object]]]: ...

    def close(self) -> None: ...


class MergedUpstream:
    """A merge (`merges:`) as its readers see it: decided once every member is; its value
    is that of the first member, in the order listed, that has an output for the row."""

    def __init__(self, members: list[Upstream]):
        self.members = members
        self.arrow_type = members[0].arrow_type  # the members share one task (dag.loader checks)

    def final_state(self, start_row: int, stop_row: int) -> np.ndarray:
        states = np.stack([m.final_state(start_row, stop_row) for m in self.members])
        merged = np.full(stop_row - start_row, FinalState.NONE, np.int8)
        merged[(states == FinalState.COMMITTED).any(axis=0)] = FinalState.COMMITTED
        merged[(states == FinalState.PENDING).any(axis=0)] = FinalState.PENDING
        return merged

    def values(self, rows: np.ndarray) -> list:
        values: list = [None] * len(rows)
        for member in self.members:
            missing = np.array([k for k, t in enumerate(values) if t is None], np.int64)
            if not len(missing):
                break
            committed = missing[member.ledger.final_state_of(rows[missing]) == FinalState.COMMITTED]
            for k, value in zip(committed.tolist(), member.values(rows[committed]) if len(committed) else []):
                values[k] = value
        return values


class NodeFeed:
    def __init__(self, node: NodeSpec, index: int, ledger: NodeLedger, source: InputSource, journal: ResultJournal,
                 upstream: dict[str, Upstream | MergedUpstream], nearest: dict[str, Nearest] | None = None, adapter: str | None = None):
        """`upstream`: the texts the node reads by name; `nearest`: the nearest lists it reads; `adapter`: what its
        requests name as their LoRA adapter (`NodeSpec.request_adapter`)."""
        self.node, self.index, self.ledger, self.source, self.journal = node, index, ledger, source, journal
        self.adapter = adapter
        self.upstream, self.nearest = upstream, nearest or {}
        self.cursor = 0
        self.retry: deque[np.ndarray] = deque()
        self._all_decided = False
        self._prompt = NodePrompt(node)
        used = set(node.columns_used) | ({node.iterate.over} if node.iterate else set())
        used |= sql_identifiers(node.where) if node.where else set()  # `where:` may read columns no template reads
        self._where_filter = WhereFilter(node.where, where=f"nodes.{node.name}.where") if node.where else None
        self._columns = [c for c in source.schema.names if c in used and c != ROW_ID]

    # -- finding ready units -----------------------------------------------------------
    def requeue(self, units: np.ndarray) -> None:
        """READY units to take before the scan's: lost with (or stopped on) an engine, or an iterating row's next step."""
        if len(units):
            self.retry.append(np.asarray(units, np.int64))

    def has_more(self) -> bool:
        """Something may still become ready here (rows undecided or units ready)."""
        return bool(self.retry) or self.cursor < self.ledger.rows

    def take_retried(self, limit: int) -> np.ndarray:
        """Up to `limit` of the retried units (`requeue`) that are READY, marked QUEUED."""
        taken: list[np.ndarray] = []
        count = 0
        while self.retry and count < limit:
            units = self.retry.popleft()
            units = np.unique(units[self.ledger.status[units] == UnitStatus.READY])
            if len(units) > limit - count:
                self.retry.appendleft(units[limit - count:])
                units = units[:limit - count]
            self.ledger.queue(units)
            taken.append(units)
            count += len(units)
        return np.concatenate(taken) if taken else np.zeros(0, np.int64)

    def take_ready(self, limit: int) -> np.ndarray:
        """Up to `limit` READY units, marked QUEUED as they are taken (so none is taken twice):
        retried ones first, then in row order. A retried unit can sit ahead of the cursor (a
        pilot's rows are taken without moving it), where the scan passes it again."""
        taken = [self.take_retried(limit)]
        count = len(taken[0])
        start, deciding = self.cursor, 0
        while count < limit and start < self.ledger.rows and deciding < DECIDING_WINDOWS:
            stop = min(start + ADMIT_WINDOW_ROWS, self.ledger.rows)
            deciding += self.admit(start, stop)
            first, last = self.ledger.unit_range(start, stop)
            ready = first + np.flatnonzero(self.ledger.status[first:last] == UnitStatus.READY)
            take = min(len(ready), limit - count)
            self.ledger.queue(ready[:take])
            taken.append(ready[:take])
            count += take
            decided = not (self.ledger.row_state[start:stop] == RowState.PENDING).any()
            if start == self.cursor and decided and take == len(ready):
                self.cursor = stop
            start = stop
        return np.concatenate(taken) if taken else np.zeros(0, np.int64)

    def take_rows(self, rows: np.ndarray) -> np.ndarray:
        """The READY first units of these rows (a pilot's sample), marked QUEUED; rows not
        decided yet are decided here (a row its `where:` drops is skipped). Rows past the
        cursor stay decided when the scan reaches them, and only READY units are taken, so
        no unit is taken twice."""
        rows = np.asarray(rows, np.int64)
        pending = rows[self.ledger.row_state[rows] == RowState.PENDING]
        if self.upstream or self.nearest:
            raise ValueError(f"node {self.node.name!r} reads upstream nodes: its rows are decided as they commit")
        kept = self._where(pending, self._where_filter) if self._where_filter is not None and len(pending) else pending
        self.ledger.skip(np.setdiff1d(pending, kept, assume_unique=True))
        self.ledger.admit(kept)
        first = self.ledger.unit_of(rows, np.zeros(len(rows), np.int64))
        units = first[self.ledger.status[first] == UnitStatus.READY]
        self.ledger.queue(units)
        return units

    def admit(self, start: int, stop: int) -> bool:
        """Decide the window's undecided rows whose upstream outputs are all there. False
        when every row of the window was decided already."""
        pending = start + np.flatnonzero(self.ledger.row_state[start:stop] == RowState.PENDING)
        if not len(pending):
            return False
        candidates = pending
        producers = [*self.upstream.values(), *self.nearest.values()]
        if producers:
            states = np.stack([u.final_state(start, stop)[pending - start] for u in producers])
            missing = (states == FinalState.NONE).any(axis=0)
            self.ledger.skip(pending[missing])
            candidates = pending[~missing & (states == FinalState.COMMITTED).all(axis=0)]
        if self._where_filter is not None and len(candidates):
            kept = self._where(candidates, self._where_filter)
            self.ledger.skip(np.setdiff1d(candidates, kept, assume_unique=True))
            candidates = kept
        self.ledger.admit(candidates)
        return True

    def admit_all(self) -> None:
        """Decide every row (the producers have finished): rows no upstream output reaches
        are skipped without the node ever running. Once: later calls do nothing."""
        if self._all_decided:
            return
        for start in range(self.cursor, self.ledger.rows, ADMIT_WINDOW_ROWS):
            self.admit(start, min(start + ADMIT_WINDOW_ROWS, self.ledger.rows))
        self._all_decided = True

    def close(self) -> None:
        """Its `where:` filter's DuckDB connection and its nearest lists' (a new feed opens them again if needed)."""
        if self._where_filter is not None:
            self._where_filter.close()
        for nearest in self.nearest.values():
            nearest.close()

    def _where(self, rows: np.ndarray, where_filter: WhereFilter) -> np.ndarray:
        table = self._rows_table(rows)
        texts = {name: pa.array(u.values(rows), u.arrow_type) for name, u in self.upstream.items()}
        table = table.append_column(POSITION, pa.array(rows, pa.int64()))
        kept = where_filter.kept(table, texts, key=POSITION)
        return np.sort(kept.to_numpy(zero_copy_only=False).astype(np.int64, copy=False))

    def _rows_table(self, rows: np.ndarray) -> pa.Table:
        """The input columns the node reads, plus `row_id`, for these (sorted) rows."""
        return self.source.rows_at(rows, self._columns)

    # -- rendering ---------------------------------------------------------------------
    def render(self, units: np.ndarray) -> list[EngineRequest]:
        """Requests for QUEUED units, in the given order."""
        if not len(units):
            return []
        rows, steps = self.ledger.row_step_of(units)
        unique_rows, where_in = np.unique(rows, return_inverse=True)
        data = self._rows_table(unique_rows).to_pylist()
        upstream: dict[str, list] = {name: u.values(unique_rows) for name, u in self.upstream.items()}
        upstream |= {name: n.values(unique_rows) for name, n in self.nearest.items()}
        previous: list[str | None] = [None] * len(units)
        later = np.flatnonzero(steps > 0)
        if len(later):
            for k, text in zip(later.tolist(), self.journal.texts(rows[later], steps[later] - 1)):
                previous[k] = text
        node = self.node
        requests = []
        for k, (unit, step) in enumerate(zip(units.tolist(), steps.tolist())):
            i = int(where_in[k])
            context = template_context(node, data[i], {n: t[i] for n, t in upstream.items()}, step, previous[k])
            where = f"nodes.{node.name} (row {data[i][ROW_ID]!r}, step {step})"
            rendered = self._prompt.render(context, where=where)
            requests.append(EngineRequest(request_id(self.index, unit), rendered.prompt, rendered.system, node.chat, node.sampling,
                                          None, node.output, rendered.messages, rendered.pair, self.adapter, rendered.images))
        return requests
