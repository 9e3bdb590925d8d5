"""The seam between the executor and whatever decides what runs next.

The executor asks a `StageChooser` for the next stage at every stage boundary, giving it
what actually happened (`NodeProgress` of each unfinished node, the `RunningPlan` of each
node's engines), and runs the stage it names. Three choosers implement it: `StagePlanner`
(a fixed cost model: batchllm's search or the Max / Min heuristics), `CalibratedStages`
(the same on a cost model calibrated while the run goes) and `SequentialStages` (no cost
model: node by node on all devices).

`RunPlanning` bundles a chooser with the observers that learn from the run for it (a
calibrated chooser's calibration and estimates) and, under a cost model, each node's answer
lengths as they are learnt (`OutputLengths`: the runtime's forecasts and the pilots' end). A `DeviceLossReplanner` is asked, on a
cluster, after engines were lost: when their nodes are gone it gives the surviving
devices and a new `RunPlanning` for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from batchllm.runtime.observer import RunObserver
from batchllm.runtime.run_state import NodeProgress, RunningPlan

if TYPE_CHECKING:
    from batchllm.costmodel.output_lengths import OutputLengths
    from batchllm.engines.devices import DeviceSet
    from batchllm.planner.schedule import Schedule
    from batchllm.planner.timeline import StageRecord
    from batchllm.runtime.run_calibration import RunCalibration


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

    def rest_s(self, progress: dict[str, NodeProgress]) -> float | None:
        """The rest of the run from where `progress` stands, no engine running (the planned
        stages start their own); None: no cost model to say."""
        ...


@dataclass(frozen=True)
class RunPlanning:
    """How a run's stages are chosen on one device set, and what learns from the run for it."""

    chooser: StageChooser
    observers: tuple[RunObserver, ...] = ()
    calibration: RunCalibration | None = field(default=None)  # what the run measured, to file in the store at its end
    lengths: Mapping[str, OutputLengths] = field(default_factory=dict)  # by node, given to each as the nodes open (NodeRun.lengths); none: no pilots, max_tokens forecasts


class DeviceLossReplanner(Protocol):
    def after_loss(self, devices: DeviceSet) -> tuple[DeviceSet, RunPlanning] | None:
        """(surviving devices, their planning) when nodes of `devices` are gone, else None."""
        ...
