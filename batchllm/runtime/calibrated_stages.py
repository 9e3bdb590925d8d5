"""Stages and estimates on the cost model a run calibrates as it goes.

`CalibratedStages` is the stage chooser of a planned run: at every stage boundary it
plans the rest of the run on `RunCalibration.calibrated_problem()` (what the run has
measured so far) and runs its first stage. `RunEstimates` is the observer that, every
`ETA_INTERVAL_S` (longer when re-estimating takes long: at most ~5 % of the time),
estimates the rest of the run the same way from where the run is, and gives each node's
finish and the run's end to the progress lines and `batchllm status`.

Neither learns anything itself: what is measured goes to the calibration.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from batchllm.runtime.observer import RunObserver, RunState
from batchllm.runtime.progress import RunProgress
from batchllm.runtime.run_calibration import RunCalibration
from batchllm.runtime.run_state import NodeProgress, RunningPlan
from batchllm.runtime.stage_chooser import StageChoice
from batchllm.runtime.stage_planner import StagePlanner, known_method

ETA_INTERVAL_S = 2.0
ETA_BUDGET_SHARE = 0.05  # re-estimating takes at most this share of the run's time


class CalibratedStages:
    def __init__(self, calibration: RunCalibration, method: str):
        self.calibration, self.method = calibration, known_method(method)

    def choose(self, progress: dict[str, NodeProgress], running: dict[str, RunningPlan]) -> StageChoice:
        """The next stage, planned on the calibrated cost model."""
        return StagePlanner(self.calibration.calibrated_problem(), self.method).choose(progress, running)

    def rest_s(self, progress: dict[str, NodeProgress]) -> float:
        """The rest of the run, planned on the calibrated cost model."""
        return StagePlanner(self.calibration.calibrated_problem(), self.method).rest_s(progress)


class RunEstimates(RunObserver):
    def __init__(self, calibration: RunCalibration, method: str, clock: Callable[[], float] = time.monotonic):
        self.calibration, self.method, self.clock = calibration, method, clock
        self._next_eta_s = 0.0

    def tick(self, now_s: float, progress: RunProgress, state: RunState) -> None:
        """Re-estimate the rest of the run when due; give the progress its ETAs."""
        started = self.clock()
        if started < self._next_eta_s:
            return
        nodes, running = state()
        if not nodes:
            return
        schedule = StagePlanner(self.calibration.calibrated_problem(), self.method).plan(nodes, running)
        finish: dict[str, float] = {}
        for stage in schedule.stages:
            for name in stage.finished:
                finish.setdefault(name, stage.end_s)
        total_s = schedule.total_s
        for name, node_progress in nodes.items():
            tail_s = self.calibration.batch_tail_s(name, node_progress) if name in finish else None
            if tail_s is not None:  # its last outputs are all running: what they still need
                total_s += tail_s - finish[name]
                finish[name] = tail_s
        progress.set_estimates(finish, max(total_s, max(finish.values(), default=0.0)), now_s)
        spent_s = self.clock() - started
        self._next_eta_s = self.clock() + max(ETA_INTERVAL_S, spent_s / ETA_BUDGET_SHARE)
