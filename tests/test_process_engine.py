"""The worker process and its queues, with a fake stepper in place of vLLM (no model)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from batchllm.core.requests import EngineRequest
from batchllm.engines.devices import Replica
from batchllm.engines.engine import EngineFailed
from batchllm.engines.process_engine import ProcessEngine
from batchllm.engines.protocol import EngineConfig
from tests.fakes import FakeStepperFactory

CONFIG = EngineConfig(model="fake", replica=Replica("cpu", (0,)))


def requests(count: int) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", f"p{i}") for i in range(count)]


def collect(engine: ProcessEngine, count: int) -> list:
    results, deadline = [], time.monotonic() + 30
    while len(results) < count and time.monotonic() < deadline:
        results += engine.poll(timeout_s=0.5)
    return results


def test_results_and_step_records_cross_the_process_boundary():
    engine = ProcessEngine(CONFIG, FakeStepperFactory())
    try:
        engine.submit(requests(5))
        results = collect(engine, 5)
        assert sorted(r.request_id for r in results) == [f"r{i}" for i in range(5)]
        assert results[0].texts == ("<p0>",)
        steps = engine.drain_steps()
        assert len(steps) == 5 and [s.decode_seqs for s in steps] == [4, 3, 2, 1, 0]
        assert sum(s.wall_s for s in steps) == pytest.approx(0.005)
        assert engine.drain_steps() == []
    finally:
        engine.stop()
    assert not engine.is_alive()


STOPPED_WORKER_SCRIPT = """
from batchllm.core.requests import EngineRequest
from batchllm.engines.process_engine import ProcessEngine
from tests.fakes import FakeStepperFactory
from tests.test_process_engine import CONFIG, collect

if __name__ == "__main__":
    engine = ProcessEngine(CONFIG, FakeStepperFactory(makes_a_lock=True))
    engine.submit([EngineRequest(f"r{i}", f"p{i}") for i in range(3)])
    print(len(collect(engine, 3)), "results")
    engine.stop()
    print("alive" if engine.is_alive() else "stopped")
"""


def test_a_stopped_worker_hands_over_its_results_and_leaves_nothing_for_the_resource_tracker(tmp_path):
    """The worker skips the interpreter's teardown (3 s with vLLM loaded) but still runs
    multiprocessing's exit handler: a semaphore it made (tqdm's lock, in vLLM) is unlinked, so the
    driver's process ends without the resource tracker's warning of a leak."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "driver.py"
    script.write_text(STOPPED_WORKER_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "3 results\nstopped\n"
    assert "leaked" not in done.stderr and "resource_tracker" not in done.stderr, done.stderr


def test_a_failing_engine_hands_over_finished_results_before_raising():
    engine = ProcessEngine(CONFIG, FakeStepperFactory(fail_at_step=3))
    try:
        engine.submit(requests(5))
        results = []
        with pytest.raises(EngineFailed, match="fake stepper broke at step 3"):
            for _ in range(60):
                results += engine.poll(timeout_s=0.5)
        assert [r.request_id for r in results] == ["r0", "r1"]
    finally:
        engine.stop()


def test_a_killed_worker_is_reported():
    engine = ProcessEngine(CONFIG, FakeStepperFactory())
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(EngineFailed, match="exited with code -9"):
        for _ in range(20):
            engine.poll(timeout_s=0.5)
    engine.stop()


def test_engines_started_side_by_side_stay_alive_and_serve():
    """Regression: engines started from pool threads were SIGKILLed when the thread ended
    (the worker's parent-death signal follows the spawning thread)."""
    from batchllm.runtime.engine_set import EngineSet

    configs = [EngineConfig(model="fake", replica=Replica("cpu", (core,))) for core in (0, 1)]
    engines = EngineSet(lambda config: ProcessEngine(config, FakeStepperFactory()))
    try:
        stopped, failed = engines.reconcile(configs)
        assert stopped == [] and failed == [] and len(engines.starts) == 2
        time.sleep(1.5)  # the worker's idle loop checks its parent every second
        for config in configs:
            engines.submit(config, requests(2))
        done, deadline = [], time.monotonic() + 30
        while len(done) < 4 and time.monotonic() < deadline:
            polled = engines.poll(timeout_s=0.5, busy=lambda slot: True)
            assert polled.losses == []
            done += polled.results
        assert len(done) == 4
    finally:
        engines.stop_all()


SCRIPT_WITHOUT_GUARD = '''
import time
from batchllm.core.requests import EngineRequest
from batchllm.engines.devices import Replica
from batchllm.engines.process_engine import ProcessEngine
from batchllm.engines.protocol import EngineConfig
from tests.fakes import FakeStepperFactory

print("script body ran", flush=True)
engine = ProcessEngine(EngineConfig(model="fake", replica=Replica("cpu", (0,))), FakeStepperFactory())
engine.submit([EngineRequest("r0", "p0")])
results, deadline = [], time.monotonic() + 30
while not results and time.monotonic() < deadline:
    results += engine.poll(timeout_s=0.5)
engine.stop()
print("answer:", results[0].texts[0])
'''


def test_a_script_without_a_main_guard_starts_workers_that_do_not_run_it_again(tmp_path):
    """Spawn would run the script again in the worker (which then tries to start a worker of
    its own, and dies); the worker is started without the caller's main module."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "no_guard.py"
    script.write_text(SCRIPT_WITHOUT_GUARD)
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["script body ran", "answer: <p0>"]
