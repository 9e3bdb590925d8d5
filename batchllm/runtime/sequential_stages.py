"""`--schedule sequential`: stages without a cost model. Each stage is the first node (in
topological order) whose producers have all finished, alone on one engine over all the
devices (on a cluster: one engine per node, over the smallest node's devices, since no
engine spans nodes); a node that follows another of the same model keeps its engine.

It needs no profile, so it is also what `--schedule plan` falls back to when a model has
none for these devices. It answers the executor as StagePlanner does, without estimates.
"""

from __future__ import annotations

import time

from batchllm.costmodel.estimator import ExecutionPlan
from batchllm.costmodel.profile import ReplicaShape
from batchllm.engines.devices import DeviceSet, whole_set_replica
from batchllm.planner.timeline import StageRecord
from batchllm.runtime.run_state import NodeProgress, RunningPlan
from batchllm.runtime.stage_chooser import StageChoice


class SequentialStages:
    method = "sequential"

    def __init__(self, devices: DeviceSet, order: list[str]):
        sizes = devices.node_sizes
        per_node = min(sizes)
        replica = whole_set_replica(DeviceSet(devices.kind, devices.ids[:per_node]))
        self._plan = ExecutionPlan(len(sizes), ReplicaShape(per_node, replica.tp))
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        self._devices = tuple(start + i for start in starts for i in range(per_node))
        self._order = order

    def rest_s(self, progress: dict[str, NodeProgress]) -> None:
        return None

    def choose(self, progress: dict[str, NodeProgress], running: dict[str, RunningPlan]) -> StageChoice:
        started = time.perf_counter()
        ready = [n for n in self._order if n in progress and progress[n].total_known]
        if not ready:
            raise ValueError(f"no node of {sorted(progress)} is ready: every one waits on an unfinished producer")
        name = ready[0]
        stage = StageRecord(index=0, start_s=0.0, duration_s=0.0, plans={name: self._plan},
                            placement={name: self._devices}, start_costs_s={name: 0.0}, finished=(name,), requests_left={})
        return StageChoice(stage, None, None, time.perf_counter() - started)
