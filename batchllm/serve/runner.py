"""How a run of batches is started and stopped: the `Runner` seam and its real implementation.

A `RunJob` is one run folder's work: the batches of a run group (`run_groups.py`), each its
request file, its results file and the prefix of its nodes. `ChildRunner` runs it in a
`python -m batchllm.serve.child` process (`child.py`: `openai_batch.run_batches`); the tests of
the lifecycle run jobs with a fake runner.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from batchllm.core.files import write_text_atomically


@dataclass(frozen=True)
class JobBatch:
    batch_id: str
    requests: Path
    results: Path  # its results file (one line per request line, in order)
    prefix: str  # before its node names in the run's DAG


@dataclass(frozen=True)
class RunJob:
    run_id: str
    batches: tuple[JobBatch, ...]
    run_dir: Path
    log: Path
    partial: str | None = None  # finish from what is committed, computing nothing; the rest's lines say this


class RunHandle(Protocol):
    def poll(self) -> int | None:
        """The exit code once it ended (0 done, 1 incomplete, 2 bad input, 130 interrupted)."""
        ...

    def interrupt(self) -> None: ...

    def kill(self) -> None: ...


class Runner(Protocol):
    def start(self, job: RunJob) -> RunHandle: ...


@dataclass(frozen=True)
class RunSettings:
    """What every run takes: the model mapping and run-batch's options."""
    models: Mapping[str, str]
    devices: str = "auto"
    engine: Mapping[str, Any] = field(default_factory=dict)
    store: Path | None = None


class _Child:
    def __init__(self, process: subprocess.Popen):
        self.process = process

    def poll(self) -> int | None:
        return self.process.poll()

    def interrupt(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class ChildRunner:
    """Each run in a `python -m batchllm.serve.child` process (its output in the job's log)."""

    def __init__(self, settings: RunSettings):
        self.settings = settings

    def start(self, job: RunJob) -> RunHandle:
        job.run_dir.parent.mkdir(parents=True, exist_ok=True)
        spec = job.run_dir.parent / ("partial-spec.json" if job.partial else "run-spec.json")
        write_text_atomically(spec, json.dumps({
            "batches": [{"requests": str(b.requests), "results": str(b.results), "prefix": b.prefix} for b in job.batches],
            "run_dir": str(job.run_dir), "partial": job.partial, "models": dict(self.settings.models),
            "devices": self.settings.devices, "engine": dict(self.settings.engine),
            "store": str(self.settings.store) if self.settings.store else None}, indent=1) + "\n")
        with open(job.log, "ab") as log:
            process = subprocess.Popen([sys.executable, "-m", "batchllm.serve.child", str(spec)], stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return _Child(process)
