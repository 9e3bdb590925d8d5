"""This process's peak resident memory, as the benchmarks report it.

`getrusage(RUSAGE_SELF).ru_maxrss` is not this process's own peak on Linux: the kernel
keeps the high-water mark of the memory image a process replaced at `exec`, and a
process started by `subprocess` (vfork + exec) replaced its parent's. So a driver started
by a benchmark that had once used 1 GB reports at least 1 GB (measured: a parent at
0.60 GB, a child Python at 11 MB, the child's ru_maxrss 0.60 GB). `VmHWM` in
/proc/self/status is of the current image only.
"""

from __future__ import annotations

import resource
import sys


def peak_rss_kb() -> int:
    """High-water mark of this process's resident memory since its exec, in KiB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # elsewhere: bytes on macOS, KiB on the BSDs
    return peak // 1024 if sys.platform == "darwin" else peak


def peak_rss_mb() -> float:
    return peak_rss_kb() / 1024
