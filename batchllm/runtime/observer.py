"""What learns from a run or reports on it while it goes (the calibration of the cost
model, the calibrated estimates of the time left): told of every engine start, every
turn's `StepResult`, and every loop turn by `tick`, which must cost nothing unless
something is due. The defaults do nothing; an observer overrides what it needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from batchllm.engines.protocol import EngineConfig, WorkerReady

if TYPE_CHECKING:
    from batchllm.runtime.progress import RunProgress
    from batchllm.runtime.run_state import NodeProgress, RunningPlan
    from batchllm.runtime.step_result import StepResult

RunState = Callable[[], "tuple[dict[str, NodeProgress], dict[str, RunningPlan]]"]  # the unfinished nodes' progress, the engines by node


class RunObserver:
    def engine_started(self, node: str, config: EngineConfig, load_time_s: float, ready: WorkerReady) -> None:
        """An engine of `node` is ready, `load_time_s` after it was launched."""

    def observe(self, result: StepResult) -> None:
        """What one turn of the executor did."""

    def tick(self, now_s: float, progress: RunProgress, state: RunState) -> None:
        """Every loop turn, `now_s` into the run; `state` gives the run's state when needed."""
