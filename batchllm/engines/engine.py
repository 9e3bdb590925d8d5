"""The two seams of the engine layer.

- `Engine`: what the runtime drives, one per replica: requests in, results and the
  engine's own step records out, stop. A vLLM engine in a worker process
  (`ProcessEngine`), one in a Ray actor (`RayEngine`), a server that already serves
  the model (`EndpointEngine`), and scripted ones in tests implement it.
- `Stepper`: what runs inside a worker process and is stepped one iteration at a time
  (`VllmStepper`; stand-ins in tests and benchmarks): the worker adds requests and steps
  while it has work, and sends each step's finished results and its record to the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from batchllm.core.requests import EngineRequest, EngineResult
from batchllm.engines.protocol import EngineConfig, StepRecord, WorkerReady


class EngineFailed(RuntimeError):
    """The engine could not start or died. `what` says which engine and when, `cause` why
    (never empty: the engine's exception, or the last error lines of its log)."""

    def __init__(self, what: str, cause: str, *, log_path: str | None = None):
        self.what, self.cause, self.log_path = what, cause or "no cause reported", log_path
        super().__init__(f"{what}: {self.cause}" + (f" (engine log: {log_path})" if log_path else ""))


class Engine(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def ready(self) -> WorkerReady:
        """What the engine reported when it came up; waits for that (EngineFailed when it cannot start)."""
        ...

    def in_flight_limit(self) -> int:
        """How many requests it takes at once now: its max_num_seqs for an engine batchllm
        starts; what the latency guard allows beside a server's online traffic."""
        ...

    def note(self) -> str | None:
        """One line on how it is doing, for the progress and `status` (a server's guard:
        what it allows and the latency it reads); None: nothing to say."""
        ...

    def submit(self, requests: Sequence[EngineRequest]) -> None: ...

    def poll(self, timeout_s: float) -> list[EngineResult]:
        """Results finished since the last poll, waiting up to `timeout_s` for the first."""
        ...

    def drain_steps(self) -> list[StepRecord]:
        """The engine's step records since the last call."""
        ...

    def stop(self) -> None: ...


EngineFactory = Callable[[EngineConfig], Engine]


class Stepper(Protocol):
    @property
    def ready(self) -> WorkerReady: ...

    def add(self, request: EngineRequest) -> EngineResult | None:
        """Take a request; a result instead when it cannot run (its finish reason says why)."""
        ...

    def has_work(self) -> bool: ...

    def step(self) -> tuple[list[EngineResult], StepRecord]:
        """One iteration: the requests it finished, and what it computed and how long it took."""
        ...


StepperFactory = Callable[[EngineConfig], Stepper]
