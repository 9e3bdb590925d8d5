"""Giving back to the OS what a run freed, before the output writes allocate anew.

The writes allocate through DuckDB's and Arrow's allocators, which cannot reuse pages
that glibc malloc keeps for the run's threads (token ids, results): freed, but resident.
Measured at 100,000 rows: 0.43 -> 0.38 GB before the writes.
"""

from __future__ import annotations

import ctypes
import gc

import pyarrow as pa


def release_free_memory() -> None:
    gc.collect()
    pa.default_memory_pool().release_unused()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only (not musl or macOS)
    if trim is not None:
        trim(0)
