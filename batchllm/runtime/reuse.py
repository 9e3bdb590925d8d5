"""A run's side of the result store: requests whose key the store holds are answered from it,
and what the engines compute goes into it.

- Before the first stage (`take_before_start`), each node in topological order has its ready
  units rendered, a window at a time, and those the store holds committed into its journal;
  a node below them then finds its rows ready. A node all of whose requests are stored
  finishes without an engine, and the planner plans only what is left. The scan of a node
  stops at the first window the store answers less than half of: what is new is not rendered
  twice before the engines start (the rest of the node is looked up as it is fed).
- While the run goes (`take_stored`), every window the feed renders is looked up before it is
  prepared for the engines: a producer that recomputed a row can give its consumer a prompt
  the store already answered. A node whose model and keys the store held nothing of as the run
  began is not looked up (a first run over a large data set pays only the filing).
- A result an engine computed (`keep`) is filed under its request's key, with the run that
  computed it, by a thread of its own (`BackgroundFiling`); one that failed (finish reason
  error) or was aborted is not, so a later run computes it again.

Invariant: a unit is taken from the store only while READY or QUEUED (never RUNNING), through
the ledger (`NodeLedger.reuse`), so it is committed once whether an engine or the store
answered it. The store is a cache: its errors never lose the run's own results (a full disk
stops keeping, with the reason printed once).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from batchllm.core.errors import UserError
from batchllm.core.requests import EngineRequest, EngineResult, FinishReason
from batchllm.io.journal_records import ResultRecord
from batchllm.io.result_store import ResultStore
from batchllm.runtime.ledger import UnitStatus
from batchllm.runtime.node_run import NodeRun, NodeRuns

SCAN_WINDOW_UNITS = 8_192  # units rendered and looked up at a time before the first stage
KEEP_BATCH = 1_024  # computed results filed in the store per transaction
NOT_KEPT = (FinishReason.ERROR, FinishReason.ABORT)


class RunReuse:
    def __init__(self, store: ResultStore, run_label: str, note: Callable[[str], None]):
        """`run_label`: the provenance filed with what this run computes (its folder and start)."""
        self.store, self.run_label, self.note = store, run_label, note
        self._keeping = True
        self._kept: list[tuple[bytes, bytes, ResultRecord]] = []
        self._filing = BackgroundFiling(store.path, run_label)

    # -- before the first stage -------------------------------------------------------------
    def take_before_start(self, nodes: NodeRuns, whole: bool = False) -> dict[str, int]:
        """Commit the ready units the store holds, node by node, producers first. Returns the
        units taken per node (nodes with none left out). A node's scan stops at a window the store
        answers less than half of (the rest is looked up as it is fed: a resumed run of new
        requests starts its engines without rendering all of them first), unless `whole`."""
        taken = {}
        for run in nodes:
            if run.keys is None or run.ledger.is_settled():
                continue
            run.store_may_answer = self.store.has_scope(run.keys.scope)
            if not run.store_may_answer:  # nothing of its model and keys: its requests are filed, not looked up
                continue
            count = 0
            for start in range(0, run.ledger.rows, _rows_per_window(run)):
                found, looked_up = self._take_window(run, start, min(start + _rows_per_window(run), run.ledger.rows))
                count += found
                if not whole and looked_up and found < looked_up / 2:
                    break
            if count:
                taken[run.name] = count
        return taken

    def _take_window(self, run: NodeRun, start: int, stop: int) -> tuple[int, int]:
        """The window's rows decided where their producers allow, and its ready units the store
        holds committed (an iterating row's next steps too, while the store holds them). Returns
        (units taken, units looked up)."""
        run.feed.admit(start, stop)
        found = looked_up = 0
        while True:
            first, last = run.ledger.unit_range(start, stop)
            ready = first + np.flatnonzero(run.ledger.status[first:last] == UnitStatus.READY)
            if not len(ready):
                return found, looked_up
            left, _ = self.take_stored(run, ready, run.feed.render(ready), remember=False)
            found, looked_up = found + len(ready) - len(left), looked_up + len(ready)
            if len(left) == len(ready) or run.spec.iterate is None:  # nothing taken, or no next steps to look at
                return found, looked_up

    # -- while the run goes -----------------------------------------------------------------
    def take_stored(self, run: NodeRun, units: np.ndarray, requests: list[EngineRequest],
                    remember: bool = True) -> tuple[np.ndarray, list[EngineRequest]]:
        """Commit the units whose requests the store answers; returns the others (units and
        requests, in order), their keys remembered for `keep` (`remember`: they go to the engines now)."""
        if run.keys is None or not len(units):
            return units, requests
        keys = run.keys.keys(requests)
        found = self.store.get_many(keys) if run.store_may_answer else {}
        if found:
            hit = np.fromiter((key in found for key in keys), bool, len(keys))
            hits = np.flatnonzero(hit)
            run.commit_stored(units[hits], [found[keys[k]].record for k in hits.tolist()])
            _note_provenance(run, units[hits], [found[keys[k]].run for k in hits.tolist()])
            missed = np.flatnonzero(~hit)
            units, requests, keys = units[missed], [requests[k] for k in missed.tolist()], [keys[k] for k in missed.tolist()]
        if remember:
            run.store_keys.update(zip(units.tolist(), keys))
        return units, requests

    def keep(self, run: NodeRun, units: np.ndarray, results: Sequence[EngineResult]) -> None:
        """File what the engines computed for `units` (their keys taken when they were rendered)."""
        if run.keys is None:
            return
        for unit, result in zip(units.tolist(), results):
            key = run.store_keys.pop(unit, None)
            if key is None or result.finish_reason in NOT_KEPT or not self._keeping:
                continue
            self._kept.append((key, run.keys.scope, ResultRecord(0, 0, result.texts, result.num_prompt_tokens, result.num_output_tokens,
                                                                 result.finish_text(), result.logprobs, result.vector, result.score)))
        if len(self._kept) >= KEEP_BATCH:
            self.flush()

    def flush(self, wait: bool = False) -> None:
        """Hand the results kept so far to the filing thread (every KEEP_BATCH, and at the end of
        the stage loop, `wait`ing until everything is filed)."""
        kept, self._kept = self._kept, []
        if kept and self._keeping:
            self._filing.file(kept)
        failure = self._filing.wait() if wait else self._filing.failure()
        if failure is not None and self._keeping:  # a full disk: the run's own results are in its journals
            self._keeping = False
            self.note(f"[yellow]results are no longer filed in the result store:[/yellow] {failure}")

    def close(self) -> None:
        self.flush(wait=True)
        self._filing.close()
        self.store.close()


class BackgroundFiling:
    """Files batches of results from a thread of its own, with a store connection of its own
    (SQLite lets go of the GIL while it writes), so the driver's loop does not wait on the disk.
    At most two batches are in its hands: a third waits for the oldest (bounded memory).

    Invariant: a batch handed over is filed, or its failure is kept (the first one) and later
    batches are dropped."""

    def __init__(self, path: Path, run_label: str):
        self._path, self._run_label = path, run_label
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-filing")
        self._store: ResultStore | None = None  # opened in the filing thread, used there only
        self._pending: deque[Future[None]] = deque()
        self._failure: str | None = None

    def file(self, entries: list[tuple[bytes, bytes, ResultRecord]]) -> None:
        while len(self._pending) >= 2:
            self._settle(self._pending.popleft())
        if self._failure is None:
            self._pending.append(self._thread.submit(self._put, entries))

    def failure(self) -> str | None:
        """The first batch's failure (why filing stopped), once its batch has settled."""
        while self._pending and self._pending[0].done():
            self._settle(self._pending.popleft())
        return self._failure

    def wait(self) -> str | None:
        """Every batch handed over filed (or failed)."""
        while self._pending:
            self._settle(self._pending.popleft())
        return self._failure

    def close(self) -> None:
        self.wait()
        self._thread.submit(self._close).result()
        self._thread.shutdown()

    def _put(self, entries: list[tuple[bytes, bytes, ResultRecord]]) -> None:
        if self._store is None:
            self._store = ResultStore(self._path)
        self._store.put_many(entries, self._run_label)

    def _close(self) -> None:
        if self._store is not None:
            self._store.close()

    def _settle(self, future: Future[None]) -> None:
        try:
            future.result()
        except UserError as error:
            self._failure = self._failure or error.paragraph()


def _rows_per_window(run: NodeRun) -> int:
    return max(1, SCAN_WINDOW_UNITS * run.ledger.rows // max(run.ledger.units, 1))


def _note_provenance(run: NodeRun, units: np.ndarray, sources: list[str]) -> None:
    """Which run computed each reused unit: a line per source run in the node's `reused.jsonl`."""
    rows, steps = run.ledger.row_step_of(units)
    by_source: dict[str, list[list[int]]] = {}
    for row, step, source in zip(rows.tolist(), steps.tolist(), sources):
        by_source.setdefault(source, []).append([row, step])
    with open(run.journal.folder / "reused.jsonl", "a", encoding="utf-8") as file:
        for source, keys in by_source.items():
            file.write(json.dumps({"computed_by": source, "rows_steps": keys}) + "\n")
