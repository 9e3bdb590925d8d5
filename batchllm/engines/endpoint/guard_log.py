"""The latency guard's log: each change of its phase or allowance as one line, with what it read
then, in the run folder beside the engines' own logs (`<out>/.batchllm/logs/engine-<model>-endpoint...log`),
so that why the batch ran as it did beside a server's online traffic can be read after the run.

    2026-11-29 09:23:41.2 UTC  slow start: in flight <= 1 -> 2 (grow); on the server 1 batch, 0 online;
    online p99 TTFT 0.25 s (target 0.49), inter-token 82 ms (target 148); held before: too few online observations x3

(one line each; "held before": why the decisions since the line before held the level, and how many did).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from batchllm.engines.endpoint.guard_targets import GuardChange


class GuardLog:
    """Appends to `path` (no file: None); times on the guard's clock become UTC through one pair of
    readings of both clocks."""

    def __init__(self, path: str | None, server_url: str):
        self._file: TextIO | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)
            self._file.write(f"the latency guard of {server_url}: each change of its phase or allowance\n")

    def write(self, changes: Iterable[GuardChange], clock_now_s: float, wall_now: dt.datetime) -> None:
        if self._file is None:
            return
        for change in changes:
            at = wall_now - dt.timedelta(seconds=clock_now_s - change.at_s)
            self._file.write(f"{at:%Y-%m-%d %H:%M:%S}.{at.microsecond // 100_000} UTC  {change.describe()}\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
