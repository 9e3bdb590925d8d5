"""One run of the real driver with the stand-in engine, for `benchmarks/scale.py`.

    .venv/bin/python benchmarks/scale_driver.py DAG OUT [--schedule auto] [--fresh]

Calls `run_dag_file` exactly as `batchllm run` does (malloc arenas limited first, as there), except that engines are
`benchmarks.standin_engine.standin_engine` (a real worker process answering at once) on
cores 0 and 1. Each engine is wrapped only to time it from the driver's side. Prints one
JSON object a line on stdout, flushed as it happens (the console goes to stderr):

    {"event": "start", "time": <epoch s>, "schedule": ..., "why": ...}
    {"event": "engine", "time": ..., "pid": <worker pid>}      an engine was started
    {"event": "ready", "time": ...}                             an engine first reported ready
    {"event": "first_submit", "time": ..., "ready_time": ...}   first requests sent; when every engine started so far was ready
    {"event": "first_result", "time": ...}                      first results received from an engine
    {"event": "done", "time": ..., "exit_code": 0|1|2, "max_rss_kb": <its VmHWM>, "cpu_s": <its threads' CPU s>,
     "first_request_s": <the driver's own or null>, "main_thread_cpu_s": <its main loop's CPU s>, ...}

`--schedule auto` takes the default (`plan`) when this CPU has a profile of every model of
the DAG, else `sequential`, and says which in the start line.
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402

from batchllm.core.errors import RunIncomplete, UserError  # noqa: E402
from batchllm.costmodel.profile import find_profile  # noqa: E402
from batchllm.dag.loader import load_dag  # noqa: E402
from batchllm.engines.devices import DeviceSet, hardware_name  # noqa: E402
from batchllm.planner.plan_file import PROFILES_ROOT  # noqa: E402
from batchllm.runtime.launch import run_dag_file  # noqa: E402
from batchllm.runtime.memory import limit_malloc_arenas  # noqa: E402
from benchmarks.peak_rss import peak_rss_kb  # noqa: E402
from benchmarks.standin_engine import standin_engine  # noqa: E402

DEVICES = DeviceSet("cpu", (0, 1))


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, "time": time.time(), **fields}), flush=True)


class _Clock:
    """What the driver did with its engines, as seen from its side of them."""

    def __init__(self):
        self.ready_times: list[float] = []  # one per engine, when its `ready` first returned
        self.engines = 0
        self.submitted = self.received = False


class _TimedEngine:
    """Forwards everything to the engine; notes when it was ready and first used."""

    def __init__(self, engine, clock: _Clock):
        self._engine, self._clock, self._ready = engine, clock, False
        self.config = engine.config

    @property
    def ready(self):
        ready = self._engine.ready
        if not self._ready:
            self._ready = True
            self._clock.ready_times.append(time.time())
            emit("ready", pid=self._engine.pid)
        return ready

    def submit(self, requests) -> None:
        if requests and not self._clock.submitted:
            self._clock.submitted = True
            emit("first_submit", ready_time=max(self._clock.ready_times, default=None), requests=len(requests))
        self._engine.submit(requests)

    def poll(self, timeout_s: float):
        results = self._engine.poll(timeout_s)
        if results and not self._clock.received:
            self._clock.received = True
            emit("first_result", results=len(results))
        return results

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def choose_schedule(dag_path: Path, wanted: str) -> tuple[str, str]:
    if wanted != "auto":
        return wanted, "asked for"
    hardware = hardware_name(DEVICES.kind)
    for model in sorted({node.model for node in load_dag(dag_path).nodes.values()}):
        try:
            find_profile(PROFILES_ROOT, hardware, model)
        except UserError:
            return "sequential", f"no profile of {model} on {hardware}"
    return "plan", f"every model has a profile on {hardware}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dag", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--schedule", default="auto")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--store", type=Path, default=None, help="the result store (none: every request computed, nothing filed)")
    args = parser.parse_args()
    schedule, why = choose_schedule(args.dag, args.schedule)
    emit("start", started=STARTED, schedule=schedule, why=why)
    clock = _Clock()

    def factory(config):
        engine = standin_engine(config)
        clock.engines += 1
        emit("engine", pid=engine.pid)
        return _TimedEngine(engine, clock)

    exit_code, result, error = 0, None, None
    limit_malloc_arenas()  # as `batchllm run` does
    try:
        outcome = run_dag_file(args.dag, args.out, DEVICES, fresh=args.fresh, console=Console(stderr=True),
                               engine_factory=factory, schedule=schedule, store=args.store)
        result = outcome[0] if isinstance(outcome, tuple) else outcome
    except UserError as failure:
        exit_code, error = 2, failure.paragraph()
    except RunIncomplete as failure:
        exit_code, error = 1, str(failure)
    first_request_s = getattr(result, "first_request_s", None)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    emit("done", exit_code=exit_code, error=error, engines_started=clock.engines, first_request_s=first_request_s,
         max_rss_kb=peak_rss_kb(), cpu_s=usage.ru_utime + usage.ru_stime, main_thread_cpu_s=time.thread_time())
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())
