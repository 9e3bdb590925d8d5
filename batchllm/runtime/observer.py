"""What an executor tells a stage chooser that learns from the run (`CalibratedRun`):
engine starts, engine steps, committed results, and a tick every loop turn (which must
cost nothing unless something is due)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from batchllm.engines.protocol import EngineConfig, EngineResult, StepRecord, WorkerReady

if TYPE_CHECKING:
    from batchllm.runtime.progress import RunProgress
    from batchllm.runtime.stage_planner import NodeProgress, RunningPlan


@runtime_checkable
class RunObserver(Protocol):
    def engine_started(self, node: str, config: EngineConfig, load_time_s: float, ready: WorkerReady) -> None: ...

    def steps(self, node: str, config: EngineConfig, steps: list[StepRecord]) -> None: ...

    def committed(self, node: str, results: list[EngineResult]) -> None: ...

    def tick(self, now_s: float, progress: RunProgress,
             state: Callable[[], tuple[dict[str, NodeProgress], dict[str, RunningPlan]]]) -> None: ...
