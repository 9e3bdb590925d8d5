"""What the run knows of each node's engines and progress at a stage boundary: the records the
executor hands its stage chooser and its observers (a leaf: no runtime module below it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from batchllm.costmodel.estimator import ExecutionPlan


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
    loading_for_s: float | None = None  # an engine started early, still loading: since how long (None: running)
