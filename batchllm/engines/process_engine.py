"""The driver's handle on one engine worker process.

`ProcessEngine` (an `Engine`, see engines/engine.py) runs any `Stepper` (the real
vLLM one by default) in a spawned process. `WorkerEngine` is the driver's side of the
worker's messages, shared with the Ray-actor engine (engines/ray_engine.py), which
runs the same worker loop inside an actor.

Start engines from the main thread: the worker dies with the thread that spawned it
(PR_SET_PDEATHSIG follows the creating thread, not the process), so an engine spawned
from a pool thread is killed when that thread ends. Construction returns at once and
`ready` waits, so starting several engines in a row loads them in parallel.
"""

from __future__ import annotations

import multiprocessing
import queue
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from batchllm.core.requests import EngineRequest, EngineResult
from batchllm.engines.engine import EngineFailed, Stepper, StepperFactory
from batchllm.engines.protocol import (
    DriverMessage,
    EngineConfig,
    StepRecord,
    StopWorker,
    SubmitRequests,
    WorkerFailed,
    WorkerMessage,
    WorkerReady,
    WorkerResults,
)
from batchllm.engines.worker import worker_main

_ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception|Exit)\b:?\s*\S")
_LOG_PREFIX = re.compile(r"^\(?[A-Za-z]*\)?\s*(?:ERROR|WARNING|INFO|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*")


def log_cause(path: str | None, lines: int = 400) -> str:
    """The last error line of an engine's log (its log prefix cut), '' when there is none:
    the cause of a worker that died without a word (killed, out of memory, a crash in C)."""
    if not path or not Path(path).is_file():
        return ""
    with open(path, "rb") as handle:
        handle.seek(max(0, handle.seek(0, 2) - 256_000))
        tail = handle.read().decode("utf-8", errors="replace").splitlines()[-lines:]
    for line in reversed(tail):
        if _ERROR_LINE.search(line) and "root cause" not in line and not line.lstrip().startswith(("File ", "raise ", "^")):
            return _LOG_PREFIX.sub("", line.strip())[:500]
    return ""


class WorkerEngine:
    """The driver's side of one engine worker, whatever carries its messages: waits for
    WorkerReady, hands requests over, collects results and step records, turns a dead
    worker into EngineFailed. Subclasses give the transport: `_send`, `_next_message`,
    `_kill`, `stop`."""

    def __init__(self, config: EngineConfig, start_timeout_s: float):
        self.config = config
        self._pending_failure: EngineFailed | None = None
        self._steps: list[StepRecord] = []
        self._start_timeout_s = start_timeout_s
        self._ready: WorkerReady | None = None

    @property
    def ready(self) -> WorkerReady:
        """What the engine reported once loaded; the first use waits for it (so several
        engines started one after another load side by side), or raises EngineFailed."""
        if self._ready is None:
            self._ready = self._wait_ready(self._start_timeout_s)
        return self._ready

    def _failure(self, what: str, cause: str = "") -> EngineFailed:
        """`cause`: what the worker said; without it, the last error line of the engine's log."""
        log = self.config.log_path if self.config.log_path and Path(self.config.log_path).is_file() else None
        return EngineFailed(f"engine for {self.config.model} {what}", cause or log_cause(log), log_path=log)

    def _send(self, message: DriverMessage) -> None:
        raise NotImplementedError

    def _next_message(self, timeout_s: float) -> WorkerMessage | None:
        """The worker's next message, None after `timeout_s`; EngineFailed if it is gone."""
        raise NotImplementedError

    def _take_nowait(self) -> WorkerMessage | None:
        return self._next_message(0.0)

    def _kill(self) -> None:
        raise NotImplementedError

    def _wait_ready(self, timeout_s: float) -> WorkerReady:
        message = self._next_message(timeout_s)
        if isinstance(message, WorkerReady):
            return message
        self._kill()
        if isinstance(message, WorkerFailed):
            raise self._failure("failed to start", message.cause)
        raise self._failure(f"did not start within {timeout_s:.0f} s")

    def in_flight_limit(self) -> int:
        return self.ready.max_num_seqs

    def note(self) -> str | None:
        return None

    def submit(self, requests: Sequence[EngineRequest]) -> None:
        if requests:
            self._send(SubmitRequests(tuple(requests)))

    def poll(self, timeout_s: float) -> list[EngineResult]:
        """Finished results; waits up to `timeout_s` for the first message.

        Results delivered before a failure are returned first; the failure is raised
        by the next call, so nothing the engine finished is ever dropped.
        """
        if self._pending_failure is not None:
            raise self._pending_failure
        results: list[EngineResult] = []
        try:
            message = self._next_message(timeout_s)
            while message is not None:
                if isinstance(message, WorkerFailed):
                    raise self._failure("failed", message.cause)
                if isinstance(message, WorkerResults):
                    results.extend(message.results)
                    self._steps.extend(message.steps)
                message = self._take_nowait()
        except EngineFailed as failure:
            if not results:
                raise
            self._pending_failure = failure
        return results

    def drain_steps(self) -> list[StepRecord]:
        """Step records received since the last call."""
        steps, self._steps = self._steps, []
        return steps

    def stop(self) -> None:
        raise NotImplementedError


class ProcessEngine(WorkerEngine):
    def __init__(self, config: EngineConfig, stepper_factory: StepperFactory, start_timeout_s: float = 1800.0):
        super().__init__(config, start_timeout_s)
        context = multiprocessing.get_context("spawn")
        self._inbox, self._outbox = context.Queue(), context.Queue()
        self._process = context.Process(
            target=worker_main, args=(config, self._inbox, self._outbox, stepper_factory), daemon=True,
            name=f"batchllm-engine-{Path(config.model).name}",
        )
        with _main_module_hidden():
            self._process.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def _send(self, message: DriverMessage) -> None:
        self._inbox.put(message)

    def _next_message(self, timeout_s: float) -> WorkerMessage | None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._outbox.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if not self._process.is_alive():
                    raise self._failure(f"exited with code {self._process.exitcode}") from None
                if time.monotonic() >= deadline:
                    return None

    def _take_nowait(self) -> WorkerMessage | None:
        try:
            return self._outbox.get_nowait()
        except queue.Empty:
            return None

    def _kill(self) -> None:
        self._process.kill()

    def stop_now(self) -> None:
        """End it without a clean shutdown (an engine still loading reads no message until it is up)."""
        self._process.kill()
        self._process.join(timeout=10)

    def stop(self) -> None:
        if self._process.is_alive():
            self._inbox.put(StopWorker())
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Spawn runs the parent's main script again in the child (as `__mp_main__`) when it can
    find it, so a script that calls batchllm at its top level, without an
    `if __name__ == "__main__":` guard, would start its whole run again in every engine
    worker. A worker needs nothing of that script (its code and arguments are batchllm's
    modules'), so the main module's name and path are hidden while a worker is spawned."""
    main = sys.modules.get("__main__")
    saved: dict[str, Any] = {key: main.__dict__[key] for key in ("__spec__", "__file__") if main is not None and key in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            if "__spec__" in saved:
                main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


def start_vllm_engine(config: EngineConfig) -> ProcessEngine:
    from batchllm.engines.vllm_stepper import VllmStepper, configure_environment

    return ProcessEngine(config, _VllmStepperFactory(configure_environment, VllmStepper))


class _VllmStepperFactory:
    """Picklable: sets the device environment in the child before vLLM is imported."""

    def __init__(self, configure: Callable[[EngineConfig], None], stepper_class: Callable[[EngineConfig], Stepper]):
        self._configure, self._stepper_class = configure, stepper_class

    def __call__(self, config: EngineConfig) -> Stepper:
        self._configure(config)
        return self._stepper_class(config)
