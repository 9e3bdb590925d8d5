"""`batchllm run` killed with SIGKILL mid-run, as a crash or an out-of-memory kill would end it:
for the real-engine tests of resuming exactly once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchllm.io.node_journal import read_records

KILL_LIMIT_S = 600  # for the first commits, engine start included


def run_command(dag: Path, out: Path) -> list[str]:
    return [str(Path(sys.executable).parent / "batchllm"), "run", str(dag), "--out", str(out), "--devices", "cpu:2"]


def committed(out: Path, nodes: tuple[str, ...]) -> int:
    """Records the nodes' journals in `out` hold now."""
    journals = [out / ".batchllm" / "journal" / node for node in nodes]
    return sum(read_records(j).num_rows for j in journals if j.exists())


def kill_after_commits(dag: Path, out: Path, nodes: tuple[str, ...], at_least: int) -> None:
    """Start `batchllm run`, SIGKILL it once the nodes' journals hold `at_least` records; the test
    fails if the run ends first or commits nothing within KILL_LIMIT_S."""
    driver = subprocess.Popen(run_command(dag, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + KILL_LIMIT_S
    while committed(out, nodes) < at_least:
        if driver.poll() is not None:
            pytest.fail(f"the run ended before the kill: {driver.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"fewer than {at_least} results committed in {KILL_LIMIT_S} s"
        time.sleep(0.02)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
