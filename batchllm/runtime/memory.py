"""Keeping the driver's memory to what it holds.

The driver's threads (the main loop, the prepare thread, the tokenizer's, the engines'
readers) allocate and free token ids and results all run long; glibc gives each new
thread an arena of its own (up to 8 per core) and keeps what they free, resident, in
them; the output writes allocate anew through DuckDB's and Arrow's allocators, which
cannot reuse those pages. So the driver's commands cap glibc's arenas at
`MALLOC_ARENAS` (`limit_malloc_arenas`), the run loop returns free pages every
`TRIM_EVERY_S` (`PeriodicTrim`), and everything is returned once more before the writes
(`release_free_memory`; measured at 100,000 rows: 0.43 -> 0.38 GB before the writes).
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Callable

import pyarrow as pa

TRIM_EVERY_S = 10.0  # a trim takes ~5-10 ms (measured on a fragmented 120 MB heap)
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


def limit_malloc_arenas(count: int = MALLOC_ARENAS) -> None:
    """Once `count` arenas exist, threads that start allocating share those there are
    instead of making more. Process-wide, and glibc cannot lift it again, so the commands
    that make this process a driver (`batchllm run`, `run-batch`) call it, not the Python
    API (in a process of yours, MALLOC_ARENA_MAX=2 does the same). A limit already set in
    the environment is kept; glibc ignores the call once it has made 8 arenas. Measured,
    1,000,000 rows through the stand-in engine: driver peak RSS 0.54 / 0.48 / 0.55 GB (full /
    interrupted / resumed pass) -> 0.50 / 0.45 / 0.52 GB (the periodic trim alone: 0.52 / 0.49 /
    0.54; both: 0.50 / 0.46 / 0.53), requests/s unchanged within noise."""
    if "MALLOC_ARENA_MAX" in os.environ or "arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # glibc only (not musl or macOS)
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, count)


def _malloc_trim() -> None:
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def release_free_memory() -> None:
    gc.collect()
    pa.default_memory_pool().release_unused()
    _malloc_trim()


class PeriodicTrim:
    """`tick()` from a loop: gives glibc's free pages back at most every `every_s`."""

    def __init__(self, every_s: float = TRIM_EVERY_S, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[], None] = _malloc_trim):
        self.every_s, self._clock, self._trim = every_s, clock, trim
        self._last_s = clock()

    def tick(self) -> None:
        now_s = self._clock()
        if now_s - self._last_s >= self.every_s:
            self._last_s = now_s
            self._trim()
