"""A nearest list (`nearest:`) as the nodes that read it see it: per row of the query node's
input, the k rows of the corpus node's input whose vectors are nearest the row's.

A row's list is decided once its query vector is committed and the corpus node has decided
every one of its rows (its list depends on all of them); a row whose query has no output has
none. The corpus's vectors are read from its journal once, at the first list asked for, and
searched by `io.vector_search`; a corpus row that failed (no vector) is never in a list.
"""

from __future__ import annotations

import numpy as np

from batchllm.dag.context import nearest_item
from batchllm.dag.model import NearestSpec
from batchllm.io.input_source import InputSource
from batchllm.io.journal_records import vector_array
from batchllm.io.vector_search import VectorSearch
from batchllm.runtime.ledger import FinalState
from batchllm.runtime.node_feed import Upstream


class NearestRows:
    def __init__(self, spec: NearestSpec, query: Upstream, corpus: Upstream, corpus_source: InputSource, dimensions: int):
        self.spec, self.query, self.corpus, self.corpus_source, self.dimensions = spec, query, corpus, corpus_source, dimensions
        self._corpus_decided = False
        self._search: VectorSearch | None = None

    def final_state(self, start_row: int, stop_row: int) -> np.ndarray:
        """Per row of [start, stop): the query's state, held PENDING while the corpus is not decided."""
        state = self.query.final_state(start_row, stop_row)
        if not self._decided():
            state[state == FinalState.COMMITTED] = FinalState.PENDING
        return state

    def values(self, rows: np.ndarray) -> list[list[dict[str, object]]]:
        """Each row's k nearest corpus rows as `nearest_item`s, nearest first (none for a row without a query vector)."""
        search = self._corpus_search()
        vectors = self.query.vectors(rows)
        present = [k for k, v in enumerate(vectors) if v is not None]
        found = search.nearest(vector_array([vectors[k] for k in present], self.dimensions), self.spec.k)
        wanted = np.unique(np.concatenate([np.asarray(p, np.int64) for p in found.positions] or [np.zeros(0, np.int64)]))
        rows_of = dict(zip(wanted.tolist(), self._corpus_rows(wanted)))
        lists: list[list[dict[str, object]]] = [[] for _ in range(len(rows))]
        for k, positions, similarities in zip(present, found.positions, found.similarities):
            lists[k] = [nearest_item(rows_of[p], s) for p, s in zip(positions, similarities)]
        return lists

    def close(self) -> None:
        if self._search is not None:
            self._search.close()
            self._search = None

    def _decided(self) -> bool:
        if not self._corpus_decided:
            rows = self.corpus.ledger.rows
            self._corpus_decided = not (self.corpus.final_state(0, rows) == FinalState.PENDING).any()
        return self._corpus_decided

    def _corpus_search(self) -> VectorSearch:
        if self._search is None:
            if not self._decided():
                raise RuntimeError(f"nearest list {self.spec.name!r} read before its corpus {self.spec.corpus!r} was decided")
            rows = np.flatnonzero(self.corpus.final_state(0, self.corpus.ledger.rows) == FinalState.COMMITTED)
            vectors = self.corpus.vectors(rows)
            kept = [k for k, v in enumerate(vectors) if v is not None]
            self._search = VectorSearch(vector_array([vectors[k] for k in kept], self.dimensions), rows[kept])
        return self._search

    def _corpus_rows(self, rows: np.ndarray) -> list[dict[str, object]]:
        """These corpus rows (sorted) as templates see rows: their input's columns and `row_id`."""
        return self.corpus_source.rows_at(rows, self.corpus_source.schema.names).to_pylist() if len(rows) else []
