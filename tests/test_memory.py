import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchllm.runtime.memory import PeriodicTrim


class Clock:
    def __init__(self):
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_trims_at_most_once_per_interval():
    clock, trims = Clock(), []
    trim = PeriodicTrim(every_s=10.0, clock=clock, trim=lambda: trims.append(clock.now_s))
    for step_s in (0.0, 4.0, 9.9, 10.0, 15.0, 19.9, 20.0, 45.0):
        clock.now_s = 100.0 + step_s
        trim.tick()
    assert trims == [110.0, 120.0, 145.0]


ARENAS_PROBE = """
import ctypes, sys, threading
from batchllm.runtime.memory import limit_malloc_arenas
if sys.argv[1] == "limited":
    limit_malloc_arenas(1)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
def report(path):
    out = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, out)
    libc.fclose(out)
report(sys.argv[2] + ".before")
start = threading.Barrier(8)
def allocate():
    start.wait()
    blocks = [libc.malloc(100_000) for _ in range(20)]
    start.wait()  # every thread holds its blocks at once
    for block in blocks:
        libc.free(block)
threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
report(sys.argv[2] + ".after")
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="glibc's malloc only (mallopt, malloc_info)")
def test_limited_arenas_keep_every_thread_in_them(tmp_path):
    """Eight threads allocating at once get arenas of their own, unless limited: then they
    share those there were (the imports' threads may have made one before the limit)."""
    def heaps(mode: str, **env: str) -> tuple[int, int]:
        report = tmp_path / mode
        subprocess.run([sys.executable, "-c", ARENAS_PROBE, mode, str(report)], check=True, cwd=Path(__file__).parent.parent,
                       env={k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")} | env)
        return tuple(Path(f"{report}.{when}").read_text().count("<heap nr=") for when in ("before", "after"))

    before, after = heaps("limited")
    assert after == before <= 2
    before, after = heaps("free")
    assert after >= before + 7
    before, after = heaps("limited", MALLOC_ARENA_MAX="4")  # the user's own limit is kept
    assert after == 4
