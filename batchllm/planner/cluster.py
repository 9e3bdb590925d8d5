"""The devices a plan is made for, the execution plans a model may take on them, and
where each plan's replicas go.

A planning device spec names hardware, not this machine's devices: `8xA100-80G`,
`2xH100-80G` (hardware from profiles/analytic/catalog.yaml or a measured profile
folder), `cpu:2` (two cores of this machine's CPU kind). Placement keeps tensor-parallel
groups inside the hardware's NVLink groups: a replica of w devices starts at a multiple
of w, so a tp2 group is always one NVLink pair on an 8xA100 node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from batchllm.costmodel.estimator import ExecutionPlan
from batchllm.costmodel.profile import Profile, ReplicaShape, find_profile
from batchllm.engines.devices import hardware_name
from batchllm.errors import UserError

_GPU_SPEC = re.compile(r"(\d+)x([A-Za-z0-9][\w.-]*)\Z")
_CPU_SPEC = re.compile(r"cpu:(\d+)\Z")


@dataclass(frozen=True)
class Cluster:
    kind: str  # "gpu" or "cpu"
    hardware: str  # profile folder name: A100-80G, cpu-intel-xeon, ...
    devices: int
    nvlink_group: int = 1  # GPUs per NVLink group (1 on CPUs: no tensor parallelism across cores)

    def __str__(self) -> str:
        return f"{self.devices}x{self.hardware}" if self.kind == "gpu" else f"cpu:{self.devices} ({self.hardware})"


def parse_cluster(text: str, profiles_root: Path) -> Cluster:
    """`8xA100-80G` or `cpu:N`; unknown hardware is an error that lists the known kinds."""
    where = "--devices"
    if match := _CPU_SPEC.match(text):
        count = int(match.group(1))
        if count < 1:
            raise UserError(f"bad device spec {text!r}: at least one core is needed", where=where)
        return Cluster("cpu", hardware_name("cpu"), count)
    match = _GPU_SPEC.match(text)
    if not match:
        raise UserError(f"bad device spec {text!r}", where=where,
                        hint="use <count>x<GPU> such as 8xA100-80G or 2xH100-80G, or cpu:N for N CPU cores")
    count, hardware = int(match.group(1)), match.group(2)
    known = _catalog_hardware(profiles_root)
    if hardware not in known and not (profiles_root / hardware).is_dir():
        raise UserError(f"unknown GPU {hardware!r} in device spec {text!r}", where=where,
                        hint=f"known GPUs: {', '.join(sorted(known))}; or profile yours with `batchllm profile`")
    if not 1 <= count <= 64:
        raise UserError(f"bad device spec {text!r}: {count} GPUs; a node has 1 to 64", where=where)
    return Cluster("gpu", hardware, count, int(known.get(hardware, {}).get("nvlink_group", 1)))


def local_cluster(kind: str, count: int) -> Cluster:
    """This machine's devices as a planning cluster (profiles filed under its hardware name)."""
    return Cluster(kind, hardware_name(kind), count)


def _catalog_hardware(profiles_root: Path) -> dict[str, dict]:
    path = profiles_root / "analytic" / "catalog.yaml"
    return yaml.safe_load(path.read_text())["hardware"] if path.is_file() else {}


def cluster_profile(cluster: Cluster, model: str, profiles_root: Path) -> tuple[Profile, str | None]:
    """The profile of `model` on the cluster's hardware, and a note when it was measured on
    another CPU kind (a CPU profile from a sibling machine beats none)."""
    try:
        return find_profile(profiles_root, cluster.hardware, model), None
    except UserError:
        if cluster.kind != "cpu":
            raise
    siblings = sorted(p.parent.parent.name for p in profiles_root.glob(f"cpu-*/{model}/profile.json"))
    if not siblings:
        raise UserError(f"no profile for model {model!r} on {cluster.hardware!r} or any other CPU under {str(profiles_root)!r}",
                        hint="run `batchllm profile --model <model>` on this machine")
    return find_profile(profiles_root, siblings[0], model), f"{model}: profile measured on {siblings[0]}, this CPU is {cluster.hardware}"


def candidate_plans(profile: Profile, cluster: Cluster) -> list[ExecutionPlan]:
    """Every (dp, replica shape) that fits on the cluster: the profile holds only valid
    shapes (heads divisible by tp, weights plus one sequence's KV cache fit)."""
    plans = []
    for key in profile.shapes:
        shape = ReplicaShape.parse(key)
        for dp in range(1, cluster.devices // shape.devices + 1):
            plans.append(ExecutionPlan(dp, shape))
    return sorted(plans, key=lambda p: (p.devices, p.shape.devices))


Placement = dict[str, tuple[int, ...]]  # node -> device ids, in replica order


def place(blocks: dict[str, tuple[int, int]], kept: Placement, devices: int) -> Placement | None:
    """Device ids for each node's replicas, or None when they do not fit.

    `blocks` maps a node to (replicas, devices per replica); the replicas in `kept` (a
    node's running replicas it keeps or takes over) stay where they are. The others are
    packed largest first, each at the lowest free offset that is a multiple of its size
    (buddy-style alignment keeps tp groups inside NVLink groups).
    """
    free = [True] * devices
    placement: dict[str, list[int]] = {}
    for node, ids in kept.items():
        if node in blocks:
            for device in ids:
                free[device] = False
            placement[node] = list(ids)
    for node in sorted(blocks, key=lambda n: -blocks[n][1]):
        replicas, size = blocks[node]
        ids = placement.setdefault(node, [])
        while len(ids) < replicas * size:
            offset = next((o for o in range(0, devices - size + 1, size) if all(free[o:o + size])), None)
            if offset is None:
                return None
            free[offset:offset + size] = [False] * size
            ids.extend(range(offset, offset + size))
    return {node: tuple(ids) for node, ids in placement.items()}
