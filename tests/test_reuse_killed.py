"""A reusing run killed with SIGKILL mid-run, then the same command: every (node, row) once, and
the same answers as a run from scratch. The killed run is a real driver process (the scripted
engine inside it answers slowly), so nothing of it runs after the kill: no `finally`, no filing
thread's last flush, a journal and a store as the kill left them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from batchllm.runtime.launch import run_dag_file
from batchllm.runtime.ledger import UNIT_BITS
from tests.fakes import FakeEngineFactory
from tests.killed_run import committed
from tests.test_reuse import CPU2, EDITED_JUDGE, ORDER, node_rows, run

ROOT = Path(__file__).resolve().parent.parent
ROWS = 40
KILL_WITHIN_S = 120

SLOW_RUN = """
import sys, time
from pathlib import Path
from rich.console import Console
from batchllm.engines.devices import DeviceSet
from batchllm.runtime.launch import run_dag_file
from tests.fakes import FakeEngineFactory, fake_text

def slow(request):
    time.sleep(0.05)
    return fake_text(request)

dag, out, store = map(Path, sys.argv[1:4])
run_dag_file(dag, out, DeviceSet("cpu", (0, 1)), console=Console(quiet=True), engine_factory=FakeEngineFactory(answer=slow),
             prefix_order=False, schedule="sequential", store=store)
"""


def test_a_reusing_run_killed_mid_run_resumes_with_every_node_and_row_once(workspace):
    rows = [f"q{k}" for k in range(ROWS)]
    pq.write_table(pa.table({"id": rows, "question": [f"question number {k}?" for k in range(ROWS)]}),
                   workspace.root / "questions.parquet")
    store = workspace.root / "store.sqlite"
    run(workspace, FakeEngineFactory(), workspace.root / "first", store=store)  # a, b and the old judge filed in the store

    edited = workspace.dag(EDITED_JUDGE, "edited.yaml")  # a and b from the store, the judge computed, slowly
    driver = subprocess.Popen([sys.executable, "-c", SLOW_RUN, str(edited), str(workspace.out), str(store)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + KILL_WITHIN_S
    while committed(workspace.out, ("judge",)) < ROWS // 4:
        assert driver.poll() is None, f"the run ended before the kill: {driver.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"fewer than {ROWS // 4} judge results committed in {KILL_WITHIN_S} s"
        time.sleep(0.02)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    judged_before = committed(workspace.out, ("judge",))
    assert judged_before < ROWS, "the kill came after the judge had finished"

    resumed = FakeEngineFactory()
    run(workspace, resumed, workspace.out, EDITED_JUDGE, store=store)
    assert {ORDER[r.request_id >> UNIT_BITS] for r in resumed.requests} <= {"judge"}  # the generators came from the store
    assert len(resumed.requests) <= ROWS - judged_before  # nothing the killed run committed is computed again
    scratch = workspace.root / "scratch"
    run_dag_file(workspace.dag(EDITED_JUDGE, "scratch.yaml"), scratch, CPU2, console=Console(quiet=True),
                 engine_factory=FakeEngineFactory(), prefix_order=False, schedule="sequential")  # no store: all computed
    for node in ORDER:
        assert sorted(r["row_id"] for r in node_rows(workspace.out, node)) == sorted(rows), node
        assert node_rows(workspace.out, node) == node_rows(scratch, node), node
