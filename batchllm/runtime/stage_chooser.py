"""The seam between the executor and whatever decides what runs next.

The executor asks a `StageChooser` for the next stage at every stage boundary, giving it
what actually happened (`NodeProgress` of each unfinished node, the `RunningPlan` of each
node's engines), and runs the stage it names. Three choosers implement it: `StagePlanner`
(a fixed cost model: batchllm's search or the Max / Min heuristics), `CalibratedStages`
(the same on a cost model calibrated while the run goes) and `SequentialStages` (no cost
model: node by node on all devices).

`RunPlanning` bundles a chooser with the observers that learn from the run for it (a
calibrated chooser's calibration and estimates). A `DeviceLossReplanner` is asked, on a
cluster, after engines were lost: when their nodes are gone it gives the surviving
devices and a new `RunPlanning` for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from batchllm.costmodel.estimator import ExecutionPlan
from batchllm.runtime.observer import RunObserver

if TYPE_CHECKING:
    from batchllm.engines.devices import DeviceSet
    from batchllm.planner.schedule import Schedule
    from batchllm.planner.timeline import StageRecord
    from batchllm.runtime.run_calibration import RunCalibration


@dataclass(frozen=True)
class NodeProgress:
    """A node's progress in the runtime's unit, (row, step): one unit asks for `sampling.n`
    sequences, which the planner counts as that many requests (`PlanNode.requests_per_unit`)."""

    done_units: int  # (row, step) units committed
    total_units: int  # (row, step) units taking part so far
    total_known: bool  # every producer has finished, so total_units is final
    running_s: float = 0.0  # served on its current plan and devices, engine start aside (after its pilot: since the rest began)
    done_units_before: int = 0  # units committed when that began (a pilot's, when the rest began after it)


class RunningSince(NamedTuple):
    """When a node began to run on its current plan (or began its rest after its pilot)."""

    at_s: float
    done_units: int


@dataclass(frozen=True)
class RunningPlan:
    """A node's engines as the last stage left them (device indices of the cluster)."""

    plan: ExecutionPlan
    devices: tuple[int, ...]


@dataclass(frozen=True)
class StageChoice:
    stage: StageRecord  # plans and device indices of the stage to run now
    rest_s: float | None  # estimated time to the end of the run, from now (None: no cost model)
    schedule: Schedule | None  # the whole plan of the rest of the run (None: no cost model)
    search_s: float


class StageChooser(Protocol):
    method: str  # how it chooses, as `--schedule` names it

    def choose(self, progress: dict[str, NodeProgress], running: dict[str, RunningPlan]) -> StageChoice:
        """The stage to run now. `progress` holds the unfinished nodes only; `running` the
        engines by node."""
        ...


@dataclass(frozen=True)
class RunPlanning:
    """How a run's stages are chosen on one device set, and what learns from the run for it."""

    chooser: StageChooser
    observers: tuple[RunObserver, ...] = ()
    calibration: RunCalibration | None = field(default=None)  # what the run measured, to file in the store at its end


class DeviceLossReplanner(Protocol):
    def after_loss(self, devices: DeviceSet) -> tuple[DeviceSet, RunPlanning] | None:
        """(surviving devices, their planning) when nodes of `devices` are gone, else None."""
        ...
