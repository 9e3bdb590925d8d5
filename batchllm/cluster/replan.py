"""What a run on a cluster does when engines are lost: if their nodes are gone, the rest of
the run is planned again on the devices that survive (the executor's units on the lost
engines are READY again already, by the ledger). An engine lost on a node that is still
alive is the executor's usual restart, not a re-plan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from batchllm.core.errors import RunIncomplete
from batchllm.engines.devices import DeviceSet

Planning = TypeVar("Planning")


@dataclass(frozen=True)
class NodeLossReplanner(Generic[Planning]):
    alive_nodes: Callable[[], set[str]]  # the cluster's nodes alive now
    planning_for: Callable[[DeviceSet], Planning]  # how stages are chosen on a device set (as at the start of the run)

    def after_loss(self, devices: DeviceSet) -> tuple[DeviceSet, Planning] | None:
        """(surviving devices, their RunPlanning) when nodes of `devices` are gone, else None."""
        lost = {n.node for n in devices.nodes} - self.alive_nodes()
        if not lost:
            return None
        surviving = devices.without_nodes(lost)
        if not surviving.ids:
            raise RunIncomplete(f"every node of the cluster is lost ({', '.join(sorted(n[:8] for n in lost))}); "
                                "results so far are kept")
        return surviving, self.planning_for(surviving)
