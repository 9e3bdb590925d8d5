"""How work is split over parts (a node's data-parallel replicas): the one load-balancing
rule of batchllm, used where the runtime splits requests and where the cost model
estimates that split, so the plan models what runs.

Longest processing time first (LPT): items in order of decreasing work, each to the part
with the least load so far (its starting load included; ties to the lowest part, then to
the earlier item), so no part is left with a tail of heavy items. Its largest part is
within 4/3 of the best possible.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def balance(work: Sequence[float] | np.ndarray, parts: int, loads: Sequence[float] | None = None) -> list[np.ndarray]:
    """Per part, the indices of the items it gets, in their given order. `loads`: what each
    part has already (e.g. its engine's running work); none by default."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    work = np.asarray(work, float)
    if loads is not None and len(loads) != parts:
        raise ValueError(f"{len(loads)} starting loads for {parts} parts")
    if parts == 1:
        return [np.arange(work.size)]
    heap = [(float(load), part) for part, load in enumerate(loads if loads is not None else [0.0] * parts)]
    heapq.heapify(heap)
    part_of = np.empty(work.size, np.int64)
    for index, item_work in zip(np.argsort(-work, kind="stable").tolist(), (-np.sort(-work, kind="stable")).tolist()):
        load, part = heap[0]
        part_of[index] = part
        heapq.heapreplace(heap, (load + item_work, part))
    return [np.flatnonzero(part_of == part) for part in range(parts)]
