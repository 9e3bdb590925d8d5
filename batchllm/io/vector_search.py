"""The k nearest vectors of a corpus, per query vector, by cosine similarity: DuckDB's array
functions (`array_cosine_similarity`, and `max_by` keeping the k largest), on one connection with
no file or network access. Exact: every query is compared with every corpus vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Nearest:
    """Per query, the positions of its nearest corpus vectors (nearest first) and their similarities."""

    positions: list[list[int]]
    similarities: list[list[float]]


class VectorSearch:
    """A corpus held once (its vectors as a fixed-size list array), searched query batch after batch."""

    def __init__(self, corpus: pa.FixedSizeListArray, positions: np.ndarray):
        """`positions`: what each corpus vector stands for (its row), returned in `Nearest.positions`."""
        if len(corpus) != len(positions):
            raise ValueError(f"{len(corpus)} corpus vectors but {len(positions)} positions")
        self.size = len(corpus)
        self._connection = duckdb.connect(config={"enable_external_access": False})
        self._connection.register("corpus", pa.table({"position": pa.array(positions, pa.int64()), "vector": corpus}))

    def nearest(self, queries: pa.FixedSizeListArray, k: int) -> Nearest:
        """The `k` nearest corpus vectors of each query (fewer when the corpus is smaller), ties by position."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k!r}")
        if not len(queries) or not self.size:
            return Nearest([[] for _ in range(len(queries))], [[] for _ in range(len(queries))])
        self._connection.register("queries", pa.table({"query": pa.array(np.arange(len(queries)), pa.int64()), "vector": queries}))
        try:
            found = self._connection.sql(f"""
                SELECT query, max_by(struct_pack(position, similarity), (similarity, -position), {int(k)}) AS nearest
                FROM (SELECT q.query, c.position, array_cosine_similarity(q.vector, c.vector) AS similarity
                      FROM queries q, corpus c)
                GROUP BY query ORDER BY query""").fetchall()
        finally:
            self._connection.unregister("queries")
        return Nearest([[hit["position"] for hit in hits] for _, hits in found],
                       [[float(hit["similarity"]) for hit in hits] for _, hits in found])

    def close(self) -> None:
        self._connection.close()
