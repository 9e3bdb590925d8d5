"""How long this process has lived: what a user waits for before a command's first line of work
(the interpreter, the imports, the checks) counts from the process's start, not from `main()`."""

from __future__ import annotations

import os
import time

_IMPORTED_AT = time.monotonic()  # the fallback where /proc cannot tell: from this module's import on


def process_age_s() -> float:
    """Seconds since the process started: on Linux the system's uptime less the process's start
    after boot (both from /proc, to a clock tick), elsewhere since this module was imported."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as uptime:
            up_s = float(uptime.read().split()[0])
        return max(0.0, up_s - float(fields[19]) / os.sysconf("SC_CLK_TCK"))  # fields[19]: starttime, field 22 of stat(5)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT
